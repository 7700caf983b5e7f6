"""Seeded training iterations of the tiny model (and, after one iteration, a greedy sampler
call), dumped to a file: run by tests/test_multidevice.py in subprocesses with 1, 2 and 8
simulated CPU devices and in two jax.distributed processes.

Usage: ``python -m tests.multidevice_iteration OUT_DIR MODEL_DIR [--iterations N]
[DATA,FSDP,TENSOR ...]``: one ``OUT_DIR/<mesh>.npz`` per mesh (``1`` without a mesh argument:
the single-device run). The iterations follow the trainer: problems from ``ProblemStream``
(each process its own rows), each iteration from the previous one's state (the sampling keys:
``sampling_key``). Under ``jax.distributed`` (``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) each process writes ``OUT_DIR/<mesh>.p<process>.npz``
with the texts of its own rows only (``row_offset``: the first one's index in the batch).
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


def sampling_key(it: int):
    """The sampling key of iteration ``it``. The tiny random model's next-token distribution is
    nearly flat (entropy ~9.5 nats), so the inverse-CDF draw of a row can flip between two
    tokens on float rounding: a mesh's reordered sums against one device's. ``key(1)`` draws
    no such row in the first iteration on any tested mesh (the trainer's
    ``fold_in(key(seed + 1), 0)`` does, on (8,1,1)); later iterations, compared between runs of
    the same mesh only, fold the iteration in as the trainer does."""
    return jax.random.key(1) if it == 0 else jax.random.fold_in(jax.random.key(1), it)


def main(out_dir: str, model_dir: str, *args: str) -> None:
    import os

    iterations = 1
    if args[:1] == ("--iterations",):
        iterations, args = int(args[1]), args[2:]
    proc = f".p{os.environ['JAX_PROCESS_ID']}" if "JAX_COORDINATOR_ADDRESS" in os.environ else ""
    if not args:
        run_one(Path(out_dir) / f"1{proc}.npz", model_dir, iterations)
    for m in args:
        data, fsdp, tensor = m.split(",")
        run_one(Path(out_dir) / f"{data}_{fsdp}_{tensor}{proc}.npz", model_dir, iterations,
                f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}")


def run_one(out: Path, model_dir: str, iterations: int, *overrides: str) -> None:
    """``iterations`` > 1 or several processes: no greedy call (its programs would only add
    compile time)."""
    cfg = load_config("demo", [
        f"model.name={model_dir}", f"rollout.rows={ROWS}", "rollout.max_new_tokens=6",
        "rollout.agent_max_new_tokens=null", "rollout.context_window=512", "train.scoring_workers=0",
        "task.train_size=50", "task.test_size=10", "ppo.epochs=2", "ppo.num_minibatches=2",
        "optim.policy_lr=1e-3", *overrides])
    run = build_run(cfg)
    try:
        learner = run.learner
        state = init_train_state(jax.random.key(cfg.train.seed), run.model.cfg, cfg.lora, cfg.team.num_agents,
                                 cfg.optim, critic_lora=cfg.ppo.critic_lora)
        state = learner.place_state(state)
        stream = ProblemStream(run.task, cfg.train.seed, rows=learner.rows)
        metrics, outputs, env_samples = [], [], 0
        for it in range(iterations):             # as the trainer's loop
            problems = stream.take(ROWS)
            state, m, texts = learner.iteration(state, problems, iteration=it, env_samples=env_samples,
                                                key=sampling_key(it))
            env_samples = int(m["env_samples"])
            metrics.append({k: v for k, v in m.items() if isinstance(v, (int, float))
                            and not k.startswith(("timing_s/", "perf/", "sampler/"))})
            outputs.append(texts.outputs)
        arrays = {}
        if iterations == 1 and learner.rows.single:     # the sampler call takes every row's prompt
            prompts = [run.tokenizer.encode_text(p.text) for p in problems]
            greedy = learner.sampler(learner.base, prompts, key=jax.random.key(2), lora=state.lora, agent=1,
                                     config=SamplingConfig(max_new_tokens=8, temperature=0.0))
            arrays = {"greedy_tokens": greedy.tokens, "greedy_lengths": greedy.lengths}
        for name, tree in (("lora", state.lora), ("critic", state.critic)):
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
                arrays[name + jax.tree_util.keystr(path)] = to_host(leaf)
        arrays["metrics"] = np.asarray(json.dumps(metrics, sort_keys=True))      # one dict per iteration
        arrays["outputs"] = np.asarray(json.dumps(outputs))                     # [iteration][step][row][agent]
        arrays["row_offset"] = np.asarray(learner.rows.bounds(ROWS)[0])
        arrays["devices"] = np.asarray(jax.device_count())
        arrays["processes"] = np.asarray(jax.process_count())
        arrays["mesh"] = np.asarray(json.dumps(dict(learner.placement.mesh.shape)))
        # one device: the weights load unplaced (build_run), so they have no spec to report
        base_specs = {} if learner.placement.mesh.size == 1 or jax.process_count() > 1 else {
            jax.tree_util.keystr(p): str(x.sharding.spec)
            for p, x in jax.tree_util.tree_leaves_with_path(learner.base)}
        arrays["base_specs"] = np.asarray(json.dumps(base_specs))
        np.savez(out, **arrays)
    finally:
        run.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
