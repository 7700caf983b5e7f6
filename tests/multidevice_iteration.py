"""One seeded training iteration of the tiny model, and a greedy sampler call, dumped to a
file: run by tests/test_multidevice.py in subprocesses with 1 and 8 simulated CPU devices.

Usage: ``python -m tests.multidevice_iteration OUT_DIR MODEL_DIR [DATA,FSDP,TENSOR ...]``: one
``OUT_DIR/<mesh>.npz`` per mesh (``1`` without a mesh argument: the single-device run). Under
``jax.distributed`` (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``)
each process writes ``OUT_DIR/<mesh>.p<process>.npz``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

from marft_jax.config import load_config  # noqa: E402
from marft_jax.models.sharding import to_host  # noqa: E402
from marft_jax.rl.state import init_train_state  # noqa: E402
from marft_jax.sampling.sampler import SamplingConfig  # noqa: E402
from marft_jax.train.build import build_run  # noqa: E402
from marft_jax.train.trainer import ProblemStream  # noqa: E402

ROWS = 8


def main(out_dir: str, model_dir: str, *meshes: str) -> None:
    import os

    proc = f".p{os.environ['JAX_PROCESS_ID']}" if "JAX_COORDINATOR_ADDRESS" in os.environ else ""
    if not meshes:
        run_one(Path(out_dir) / f"1{proc}.npz", model_dir)
    for m in meshes:
        data, fsdp, tensor = m.split(",")
        run_one(Path(out_dir) / f"{data}_{fsdp}_{tensor}{proc}.npz", model_dir,
                f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}")


def run_one(out: Path, model_dir: str, *overrides: str) -> None:
    cfg = load_config("demo", [
        f"model.name={model_dir}", f"rollout.rows={ROWS}", "rollout.max_new_tokens=6",
        "rollout.agent_max_new_tokens=null", "rollout.context_window=512", "train.scoring_workers=0",
        "task.train_size=50", "task.test_size=10", "ppo.epochs=2", "ppo.num_minibatches=2",
        "optim.policy_lr=1e-3", *overrides])
    run = build_run(cfg)
    try:
        learner = run.learner
        state = init_train_state(jax.random.key(0), run.model.cfg, cfg.lora, cfg.team.num_agents,
                                 cfg.optim, critic_lora=cfg.ppo.critic_lora)
        state = learner.place_state(state)
        problems = ProblemStream(run.task, 0).take(ROWS)
        state, metrics, texts = learner.iteration(state, problems, iteration=0, env_samples=0,
                                                  key=jax.random.key(1))
        prompts = [run.tokenizer.encode_text(p.text) for p in problems]
        greedy = learner.sampler(learner.base, prompts, key=jax.random.key(2), lora=state.lora, agent=1,
                                 config=SamplingConfig(max_new_tokens=8, temperature=0.0))
        arrays = {"greedy_tokens": greedy.tokens, "greedy_lengths": greedy.lengths}
        for name, tree in (("lora", state.lora), ("critic", state.critic)):
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
                arrays[name + jax.tree_util.keystr(path)] = to_host(leaf)
        kept = {k: v for k, v in metrics.items() if isinstance(v, (int, float))
                and not k.startswith(("timing_s/", "perf/", "sampler/"))}
        arrays["metrics"] = np.asarray(json.dumps(kept, sort_keys=True))
        arrays["outputs"] = np.asarray(json.dumps(texts.outputs))
        arrays["devices"] = np.asarray(jax.device_count())
        arrays["processes"] = np.asarray(jax.process_count())
        arrays["mesh"] = np.asarray(json.dumps({} if learner.placement is None
                                               else dict(learner.placement.mesh.shape)))
        base_specs = {} if learner.placement is None or jax.process_count() > 1 else {
            jax.tree_util.keystr(p): str(x.sharding.spec)
            for p, x in jax.tree_util.tree_leaves_with_path(learner.base)}
        arrays["base_specs"] = np.asarray(json.dumps(base_specs))
        np.savez(out, **arrays)
    finally:
        run.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
