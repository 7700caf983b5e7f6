"""One whole MARFT training iteration: ours vs the reference (G1) pipeline in PyTorch, one run.

Prints ONE JSON object (the last stdout line). Both sides play the same problems with the same
host code (:func:`marft_jax.rl.rollout.rollout`: same prompts, same scorer), from the same
initial weights (the model, our initial LoRA stack and critic head), and each runs in its own
subprocess, so ``peak_rss_bytes`` (``ru_maxrss``) is per side.

**Ours**: :meth:`TeamLearner.iteration` built by ``build_run(load_config(...))``. Warm-up
iteration(s) first, on the measured iteration's problems and sampling key, so they compile the
programs the measured one runs (``warmup_s``; ``compile_s`` = the first warm-up minus the
measured iteration; XLA backend compile time is also summed by a ``jax.monitoring`` listener,
``backend_compile_s``, and should be ~0 in the measured iteration). Stage times are the
iteration's metrics ``timing_s/rollout``, ``timing_s/values_logprobs_backup`` (old log-probs,
critic features, backup) and ``timing_s/update``.

**Reference**: :mod:`marft_jax.bench.g1_pipeline`: HF ``generate`` (T / top-k of the workload,
fresh ``GenerationConfig``) with one PEFT model copy per agent as the rollout's generate
function, G1's critic and two-forward log-prob passes over padded batches with the
``[B, 1, K, V]`` log-softmax, G1's Python-loop backup, then ``bench/update.py``'s
``G1Baseline`` step on the played steps. A 2-token ``generate`` per agent warms it up.

Per stage and side: seconds, ``valid_tokens`` / ``computed_tokens`` (real tokens / padded
positions the stage's passes read: for the rollout, prompts + generated tokens / the prefill's
prompt bucket x batch bucket plus one token per row and decode step; for the other stages,
summed over their forward passes as our ``perf/tokens/{prepare,update}/{valid,computed}``
metrics define them: ours reads those metrics (``token_counts``: ``metrics``, else ``shapes``
from the padded layout); the reference counts each critic, ``rho`` and ``pi`` forward),
analytic matmul FLOPs of what that side computes (``bench/update.py``'s counting; ours per
computed token, with the update's backward, HAPPO forwards and remat recompute), FLOP/s, and
the fraction of that side's float32 matmul roofline measured in the same process (``jnp`` for
ours, ``torch`` for the reference; best of before and after).
``ratio_per_env_step`` = reference seconds per env step / ours (env step = one played
(step, row), as ``env_samples`` counts them; both sides may play a different number when
episodes end on a correct answer).

**The floor** (:mod:`marft_jax.bench.floor`, docs/benchmarks.md "The floor"): each side's
minimal FLOPs and bytes per stage (prefill, decode, critic features, update) on its own
trajectory, over the best float32 matmul roofline and read bandwidth (``jnp.sum`` over
``--bandwidth-mib``) any side measured in this run; a stage's ``floor_s`` is
``max(flops / roofline, bytes / bandwidth)``, the iteration's the sum. Reported per side as
``floor_s`` and ``over_floor`` (measured / floor; ours also for prefill and decode apart), on
the measured stages (the rollout holds prefill + decode), and at the top as ``floor``,
``ours_over_floor`` and ``reference_over_floor``. With ``--reference-omp best`` (default) the
reference's rollout runs once more in a rollout-only child without ``OMP_WAIT_POLICY=PASSIVE``
and the faster rollout is kept (``rollout_s_by_omp_wait_policy``, ``rollout_omp_wait_policy``).

Workloads: ``reference`` (the G1 sample run: dual team, MATH, 4 rows x horizon 3, 128 new
tokens, T 0.5 / top-k 50, G1 raw prompts, APPO, SmolLM2-135M, float32, remat), ``long``
(8 rows, horizon 1, 512 new tokens, long MATH problems so the actor's contexts reach ~1k
tokens), ``tiny`` (a random 2-layer model written to a temporary directory, generated
arithmetic; the smoke test). ``--no-eos`` removes the stop tokens on both sides, so every
response runs to the token budget and both sides do the same work.

Usage::

    python -m marft_jax.bench.iteration --workload reference          # = marft-jax bench iteration
    python -m marft_jax.bench.iteration --workload long --no-eos
    python -m marft_jax.bench.iteration --workload reference --rows 2 --horizon 1   # reduced
    python -m marft_jax.bench.iteration --workload tiny --roofline-n 128          # seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

STAGES = ("rollout", "values_logprobs_backup", "update")
REPO = Path(__file__).resolve().parents[2]
DEFAULT_MATH = REPO.parent / "shared" / "data" / "math_train.json"

# A random 2-layer Llama with the embedded SmolLM2 tokenizer's vocabulary (the smoke workload).
TINY_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu",
}


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named run: config overrides, and an optional agent-0 context length range (tokens) the
    chosen problems must fall in (taken in the task's seeded order)."""

    name: str
    overrides: tuple[str, ...]
    agent0_context: tuple[int, int] | None = None


_COMMON = ("model.dtype=float32", "model.remat=auto", "algo.level=action", "ppo.epochs=1",
           "ppo.num_minibatches=1", "ppo.micro_batches=1", "rollout.temperature=0.5", "rollout.top_k=50",
           "rollout.top_p=1.0", "rollout.prompt_format=g1_raw", "rollout.mode=sequential",
           "team.num_agents=2", "train.scoring_workers=0", "train.iterations=1")


def workload(name: str, *, math_path: str, model_dir: str | None = None) -> Workload:
    if name == "reference":
        return Workload(name, _COMMON + ("model.name=smollm2-135m", "task.name=math", f"task.path={math_path}",
                                         "team.profile=math/dual", "rollout.rows=4", "rollout.horizon=3",
                                         "rollout.max_new_tokens=128", "rollout.context_window=2048"))
    if name == "long":
        # agent 0 reads 380-480 tokens; the actor then reads that + the reasoner's 512 (~0.9-1k)
        return Workload(name, _COMMON + ("model.name=smollm2-135m", "task.name=math", f"task.path={math_path}",
                                         "team.profile=math/dual", "rollout.rows=8", "rollout.horizon=1",
                                         "rollout.max_new_tokens=512", "rollout.context_window=2048"),
                        agent0_context=(380, 480))
    if name == "tiny":
        if model_dir is None:
            raise ValueError("the tiny workload needs --model-dir (the parent process writes one)")
        return Workload(name, _COMMON + (f"model.name={model_dir}", "task.name=arithmetic", "task.train_size=50",
                                         "task.test_size=10", "team.profile=math/duo-short", "rollout.rows=2",
                                         "rollout.horizon=2", "rollout.max_new_tokens=8",
                                         "rollout.context_window=512"))
    raise ValueError(f"unknown workload {name!r}; known: reference, long, tiny")


def write_tiny_model(root: Path) -> Path:
    """config.json, random model.safetensors and the embedded SmolLM2 tokenizer (no network)."""
    from safetensors.numpy import save_file

    from marft_jax.models import gguf_loader, registry
    from marft_jax.models.config import ModelConfig
    from marft_jax.models.weights import expected_shapes

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(TINY_CONFIG))
    rng = np.random.default_rng(0)
    tensors = {name: (1.0 + 0.1 * rng.standard_normal(shape) if "norm" in name
                      else 0.2 * rng.standard_normal(shape)).astype(np.float32)
               for name, shape in expected_shapes(ModelConfig.from_hf(TINY_CONFIG)).items()}
    save_file(tensors, str(root / "model.safetensors"))
    gguf_loader.gguf_tokenizer(registry.embedded_gguf_path()).save_pretrained(str(root))
    return root


def config_for(args) -> tuple[Workload, Any]:
    from marft_jax.config import load_config

    wl = workload(args.workload, math_path=args.math_path, model_dir=args.model_dir)
    extra = []
    if args.rows is not None:
        extra.append(f"rollout.rows={args.rows}")
    if args.horizon is not None:
        extra.append(f"rollout.horizon={args.horizon}")
    if args.new_tokens is not None:
        extra.append(f"rollout.max_new_tokens={args.new_tokens}")
    return wl, load_config(None, list(wl.overrides) + extra + list(args.overrides))


def select_problems(run, wl: Workload, rows: int) -> list:
    """The first ``rows`` training problems in the task's seeded order (within the workload's
    agent-0 context range, if it has one), the same on both sides."""
    from marft_jax.rl import rollout as rollout_lib

    cfg = run.learner.rollout_cfg
    out = []
    for p in run.task.problems("train", run.config.train.seed):
        if wl.agent0_context is not None:
            n = len(rollout_lib._context(run.team, p, 0, [], {}, cfg, run.tokenizer))
            if not wl.agent0_context[0] <= n <= wl.agent0_context[1]:
                continue
        out.append(p)
        if len(out) == rows:
            return out
    raise ValueError(f"workload {wl.name!r}: only {len(out)} problems fit (need {rows})")


def _stage(s: float, valid: int, computed: int, flops: float, roofline: float) -> dict:
    return {"s": s, "valid_tokens": int(valid), "computed_tokens": int(computed), "flops": flops,
            "flops_per_s": flops / max(s, 1e-12), "roofline_fraction": flops / max(s, 1e-12) / roofline}


def _weight_itemsize(params) -> int:
    """Bytes per element of the base weights (their widest floating dtype)."""
    import jax
    import jax.numpy as jnp

    return max(jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating))


def _floor_work(mcfg, cfg, learner, traj, itemsize: int) -> dict:
    """This side's minimal work per floor stage (:func:`marft_jax.bench.floor.stage_work`) on
    its own trajectory."""
    from marft_jax.bench import floor

    from marft_jax.sampling.sampler import decode_weight_bytes

    t = lambda x: None if x is None else np.asarray(x)
    # our decode steps read the checkpoint's blocks when the sampler has them (the reference side
    # holds no JAX weights: it decodes float32 in PyTorch, its floor counts float32)
    sampler = learner.sampler                     # a CountingSampler forwards these to ours
    blocks = getattr(sampler, "quantized", None)
    decode_bytes = (None if blocks is None or learner.base is None else
                    float(decode_weight_bytes(sampler.with_quantized(learner.base), None, mcfg)))
    return floor.stage_work(mcfg, ctx_tokens=t(traj.ctx_tokens), ctx_valid=t(traj.ctx_valid),
                            act_tokens=t(traj.act_tokens), act_valid=t(traj.act_valid), step_mask=t(traj.step_mask),
                            boot_ctx_tokens=t(traj.boot_ctx_tokens), boot_ctx_valid=t(traj.boot_ctx_valid),
                            critic_ctx_tokens=t(traj.critic_ctx_tokens), critic_ctx_valid=t(traj.critic_ctx_valid),
                            itemsize=itemsize, epochs=cfg.ppo.epochs,
                            happo=bool(learner.update_cfg.happo_weighting), critic_lora=bool(cfg.ppo.critic_lora),
                            decode_weight_bytes=decode_bytes)


def _read_bandwidth(mib: int) -> float:
    from marft_jax.train.peaks import measured_read_bandwidth

    return measured_read_bandwidth(int(mib) << 20)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


# ----------------------------------------------------------------------------------------------
# Ours.


class CountingSampler:
    """Wraps our :class:`~marft_jax.sampling.sampler.Sampler`: counts valid / computed tokens and
    FLOPs of every call from its padded shapes (prompt bucket x batch bucket for the prefill, one
    token per row and decode step, each step attending over its decode phase's cache bound);
    compaction of finished rows is not seen from outside, so with EOS on this is an upper bound
    (exact with ``no_eos``: no row finishes early). With ``no_eos`` it removes the stop set."""

    def __init__(self, inner, cfg, no_eos: bool):
        from marft_jax.bench.g1_pipeline import StageWork

        self.inner, self.cfg, self.no_eos = inner, cfg, no_eos
        self.work = StageWork()

    def __getattr__(self, name):   # everything else (take_totals, ...) is the wrapped sampler's
        return getattr(self.inner, name)

    def __call__(self, params, prompts, *, key, config, stop_ids=None, **kw):
        from marft_jax.bench.g1_pipeline import decode_flops
        from marft_jax.bench.update import _body_flops
        from marft_jax.sampling import buckets
        from marft_jax.sampling import sampler as sampler_lib

        s = self.inner
        tot = getattr(s, "totals", None)
        before = None if tot is None else (tot.prefill_slots, getattr(tot, "prefill_reused", 0))
        out = self.inner(params, prompts, key=key, config=config, stop_ids=() if self.no_eos else stop_ids, **kw)
        pad_kw = dict(pad_id=s.pad_id, min_length=s.min_prompt_bucket, max_length=s.max_prompt_len,
                      min_batch=s.min_batch, max_batch=s.max_batch)
        if hasattr(s, "fine_above"):
            pad_kw["fine_above"] = s.fine_above
        b, plen = buckets.pad_prompts(prompts, **pad_kw).tokens.shape
        max_new = config.max_new_tokens
        phases = sampler_lib.decode_phases(plen, max_new) if hasattr(sampler_lib, "decode_phases") else (max_new,)
        keys_at = lambda t: plen + min((n for n in phases if n > t), default=max_new)
        steps = int(out.steps)
        prefill_slots, flops = b * plen, decode_flops(self.cfg, b, plen, steps, keys_at)
        if before is not None and s.totals.prefill_reused > before[1]:
            # rollout.reuse_prefix: the prefill computed only the prompts' rest (attention to the
            # copied prefix not counted); the decode steps still read the whole prompt's keys
            prefill_slots = s.totals.prefill_slots - before[0]
            flops -= _body_flops(self.cfg, b, plen) - _body_flops(self.cfg, b, prefill_slots // b)
        self.work.add(sum(len(p) for p in prompts) + int(np.asarray(out.lengths).sum()),
                      prefill_slots + b * max(steps - 1, 0), flops)
        return out


def ours_prepare_update_work(mcfg, traj, m: dict, adv_cfg, update_cfg) -> tuple[dict, str]:
    """``{"prepare"|"update": (valid, computed, flops)}`` and where the token counts came from.

    Token counts: the iteration's ``perf/tokens/{prepare,update}/{valid,computed}`` metrics (the
    packed or padded inputs of the feature pass, the old-log-prob recompute if any, and the
    update's policy forwards once per epoch), else the padded layout. FLOPs: those computed
    tokens through the decoder blocks, attention over half the mean sequence (the mean valid
    context + response of a played decision), LM head at the action positions where logits are
    formed; the update counts forward + backward (1x blocks: the base is frozen; 2x head),
    HAPPO's extra forwards and the remat recompute (``bench/update.py``'s ``ours_flops``
    structure, applied per token)."""
    from marft_jax.models.decoder import resolve_remat

    S, B, N, L, K = traj.shape
    played = np.asarray(traj.step_mask)[:, :, None] & np.ones((1, 1, N), bool)
    ctx_len = np.asarray(traj.ctx_valid).sum(-1)[played]
    act_len = np.asarray(traj.act_valid).sum(-1)[played]
    acts = int(act_len.sum())
    seq_mean = float((ctx_len + act_len).mean()) if ctx_len.size else 1.0
    head = 2.0 * mcfg.hidden_size * mcfg.vocab_size
    body = mcfg.flops_per_token(int(seq_mean) // 2) - head                # per token through the blocks
    recompute = adv_cfg.ppo.logp_old == "recompute"
    epochs = update_cfg.ppo.epochs
    happo = (N - 1) / N if update_cfg.happo_weighting else 0.0
    policy = resolve_remat(update_cfg.remat, int(seq_mean))
    remat = 0.0 if policy == "none" else 1.0
    if policy == "keep_attention" and mcfg.causal_attention == "native":   # the recompute skips attention
        remat = (mcfg.flops_per_token(0) - head) / body
    valid = int(ctx_len.sum() + act_len.sum())
    source = "metrics"
    prep = (m.get("perf/tokens/prepare/valid"), m.get("perf/tokens/prepare/computed"))
    if prep[0] is None or prep[1] is None:
        source = "shapes"
        prep = (int(ctx_len.sum()) + valid * recompute, S * B * N * (L + (L + K) * recompute))
    upd = (m.get("perf/tokens/update/valid"), m.get("perf/tokens/update/computed"))
    if upd[0] is None or upd[1] is None:
        source = "shapes"
        upd = (valid * epochs, epochs * S * B * N * (L + K))
    prep_flops = prep[1] * body + (acts * head if recompute else 0.0)
    upd_flops = upd[1] * body * (2.0 + happo + remat) + epochs * acts * head * (3.0 + happo)
    return {"prepare": (int(prep[0]), int(prep[1]), prep_flops),
            "update": (int(upd[0]), int(upd[1]), upd_flops)}, source


def run_ours(args) -> dict:
    import jax

    from marft_jax import profiling
    from marft_jax.bench.sampler import matmul_roofline_flops
    from marft_jax.train.build import build_run, fresh_state

    wl, cfg = config_for(args)
    compile_s = [0.0]

    def on_event(event: str, duration: float, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compile_s[0] += duration

    jax.monitoring.register_event_duration_secs_listener(on_event)
    run = build_run(cfg)
    try:
        mcfg = run.model.cfg
        counter = CountingSampler(run.learner.sampler, mcfg, args.no_eos)
        captured: dict[str, Any] = {}

        class CapturingLearner(type(run.learner)):
            """The run's learner, keeping the trajectory its play returns."""

            def play(self, *a, **k):
                captured["traj"], texts = super().play(*a, **k)
                return captured["traj"], texts

        fields = {f.name: getattr(run.learner, f.name) for f in dataclasses.fields(run.learner)}
        learner = run.learner = CapturingLearner(**{**fields, "sampler": counter})
        state = fresh_state(cfg, mcfg)
        problems = select_problems(run, wl, cfg.rollout.rows)
        key = jax.random.fold_in(jax.random.key(cfg.train.seed + 1), 0)
        roof = [matmul_roofline_flops(args.roofline_n)]
        bandwidth = [_read_bandwidth(args.bandwidth_mib)]
        itemsize = _weight_itemsize(run.model.params)
        warmup_s, warmup_compile_s = [], []
        for w in range(args.warmup):
            compile_s[0] = 0.0
            t0 = time.perf_counter()
            state, _, _ = learner.iteration(state, problems, iteration=w, env_samples=0, key=key)
            warmup_s.append(time.perf_counter() - t0)
            warmup_compile_s.append(compile_s[0])
        counter.work = type(counter.work)()
        compile_s[0] = 0.0
        t0 = time.perf_counter()
        with profiling.trace(os.environ.get(profiling.ENV_DIR)):   # `marft-jax bench iteration --profile DIR`
            state, m, _ = learner.iteration(state, problems, iteration=args.warmup, env_samples=0, key=key)
        wall = time.perf_counter() - t0
        measured_compile = compile_s[0]
        roof.append(matmul_roofline_flops(args.roofline_n))
        bandwidth.append(_read_bandwidth(args.bandwidth_mib))
    finally:
        run.close()
    roofline = max(roof)
    traj = captured["traj"]
    S, B, N, L, K = traj.shape
    work, source = ours_prepare_update_work(mcfg, traj, m, learner.adv_cfg, learner.update_config())
    stages = {
        "rollout": _stage(m["timing_s/rollout"], counter.work.valid_tokens, counter.work.computed_tokens,
                          counter.work.flops, roofline),
        "values_logprobs_backup": _stage(m["timing_s/values_logprobs_backup"], *work["prepare"], roofline),
        "update": _stage(m["timing_s/update"], *work["update"], roofline),
    }
    env_steps = int(np.asarray(traj.step_mask).sum())
    return {
        "side": "ours", "floor_work": _floor_work(mcfg, cfg, learner, traj, itemsize),
        "read_bandwidth_bytes_per_s": max(bandwidth), "read_bandwidth_samples": bandwidth,
        "rollout_split_s": {"prefill": m.get("timing_s/rollout/prefill"),
                            "decode": m.get("timing_s/rollout/decode")},
        "env_steps": env_steps, "s": wall, "s_per_env_step": wall / env_steps,
        "stages": stages, "peak_rss_bytes": _peak_rss_bytes(), "token_counts": source,
        "warmup_s": warmup_s, "compile_s": max(warmup_s[0] - wall, 0.0) if warmup_s else None,
        "backend_compile_s": {"warmup": warmup_compile_s, "measured": measured_compile},
        "sampler_calls": counter.work.calls, "shapes": {"S": S, "B": B, "N": N, "L": L, "K": K},
        "logp_old": learner.adv_cfg.ppo.logp_old,
        "pack_sequences": getattr(learner, "pack_sequences", False),
        "remat": learner.update_config().remat,
        "matmul_roofline_flops_per_s": roofline, "matmul_roofline_samples": roof,
        "episode_accuracy": m.get("episode/accuracy"),
        "completions_mean_length": {k.split("/")[1]: v for k, v in m.items()
                                    if k.startswith("completions/") and k.endswith("mean_length")},
        "jax_version": jax.__version__, "jax_backend": jax.default_backend(),
    }


# ----------------------------------------------------------------------------------------------
# The reference pipeline.


def run_reference(args) -> dict:
    import jax
    import torch

    from marft_jax.bench.g1_pipeline import G1Pipeline
    from marft_jax.bench.machine import torch_matmul_flops
    from marft_jax.bench.update import LORA
    from marft_jax.rl.rollout import rollout
    from marft_jax.train.build import build_run, fresh_state

    torch.set_num_threads(args.torch_threads or os.cpu_count() or 1)
    wl, cfg = config_for(args)
    lc = cfg.lora
    if (lc.rank, lc.alpha, tuple(lc.targets)) != (LORA.rank, LORA.alpha, tuple(LORA.targets)):
        raise ValueError(f"the G1 baseline (bench/update.py) uses LoRA r{LORA.rank}/alpha {LORA.alpha} on "
                         f"{LORA.targets}; the run has r{lc.rank}/alpha {lc.alpha} on {lc.targets}")
    run = build_run(cfg)
    try:
        mcfg, tok, learner = run.model.cfg, run.tokenizer, run.learner
        n = cfg.team.num_agents
        state = fresh_state(cfg, mcfg)
        lora0 = jax.tree.map(np.array, state.lora)                       # the same initial adapters as ours
        head0 = jax.tree.map(np.array, state.critic.head)
        rcfg = learner.rollout_cfg
        K = max(rcfg.budget(i) for i in range(n))
        itemsize = _weight_itemsize(run.model.params)
        pipe = G1Pipeline(mcfg, run.model.params, lora0, head0, learner.update_cfg, act_len=K, pad_id=tok.pad_id,
                          stop_ids=tok.stop_ids, temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k,
                          top_p=cfg.rollout.top_p, no_eos=args.no_eos, seed=cfg.train.seed)
        del state
        run.model = None                                                  # the JAX copy of the weights
        learner = run.learner = dataclasses.replace(learner, base=None)
        gc.collect()
        problems = select_problems(run, wl, cfg.rollout.rows)
        key = jax.random.fold_in(jax.random.key(cfg.train.seed + 1), 0)
        roof = [torch_matmul_flops(args.roofline_n)]
        bandwidth = [_read_bandwidth(args.bandwidth_mib)]
        t0 = time.perf_counter()
        first = tok.encode_text("Warm-up.")
        for i in range(n):
            pipe.generate([first], np.array([i]), 2, key)
        warmup_s = time.perf_counter() - t0
        pipe.work = {k: type(v)() for k, v in pipe.work.items()}
        t0 = time.perf_counter()
        traj, _ = rollout(problems, team=run.team, tokenizer=tok, generate=pipe.generate, score=run.pool.score,
                          cfg=rcfg, key=key)
        t1 = time.perf_counter()
        if args.rollout_only:                                             # the OMP_WAIT_POLICY probe
            return {"side": "reference", "rollout_only": True, "rollout_s": t1 - t0,
                    "env_steps": int(np.asarray(traj.step_mask).sum()),
                    "generated_tokens": int(np.asarray(traj.act_valid).sum()),
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
        batch = pipe.prepare(traj, gamma=cfg.gamma, lam=cfg.lam)
        t2 = time.perf_counter()
        pipe.update(batch)
        t3 = time.perf_counter()
        roof.append(torch_matmul_flops(args.roofline_n))
        bandwidth.append(_read_bandwidth(args.bandwidth_mib))
    finally:
        run.close()
    roofline = max(roof)
    times = {"rollout": t1 - t0, "values_logprobs_backup": t2 - t1, "update": t3 - t2}
    stages = {k: _stage(times[k], pipe.work[k].valid_tokens, pipe.work[k].computed_tokens, pipe.work[k].flops,
                        roofline) for k in STAGES}
    env_steps = int(np.asarray(traj.step_mask).sum())
    lengths = np.asarray(traj.act_valid).sum(-1)
    played = np.asarray(traj.step_mask)
    return {
        "side": "reference", "floor_work": _floor_work(mcfg, cfg, learner, traj, itemsize),
        "read_bandwidth_bytes_per_s": max(bandwidth), "read_bandwidth_samples": bandwidth,
        "env_steps": env_steps, "s": t3 - t0, "s_per_env_step": (t3 - t0) / env_steps,
        "stages": stages, "peak_rss_bytes": _peak_rss_bytes(), "warmup_s": warmup_s,
        "generate_calls": pipe.work["rollout"].calls,
        "update_shapes": [{"rows": int(b.ctx_tokens.shape[1]), "N": n, "L": G1Pipeline.agent_lengths(b), "K": K}
                          for b in batch],
        "matmul_roofline_flops_per_s": roofline, "matmul_roofline_samples": roof,
        "completions_mean_length": {role: float(lengths[..., i][played].mean())
                                    for i, role in enumerate(run.team.roles)},
        "desc": ("HF generate per agent (own PEFT base copy), prompts padded to the call's longest; G1 critic "
                 "CausalLM forward + two policy forwards per (step, agent), [B,1,K,V] fp32 log-softmax, Python "
                 "loops; G1 buffer-loop backup; bench/update.py G1Baseline step on each played step's rows (G1 "
                 "updates once per one-step iteration), each agent's contexts padded to its own longest"),
        "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }


# ----------------------------------------------------------------------------------------------


def _git_commit() -> dict:
    def git(*a):
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain", "-uno"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _side_command(side: str, argv: Sequence[str], model_dir: str | None, result: Path,
                  omp_passive: bool = True) -> tuple[list[str], dict]:
    """The child's command and environment; ``omp_passive=False``: the reference's rollout-only
    probe without ``OMP_WAIT_POLICY`` (libgomp's default spin-then-sleep)."""
    cmd = [sys.executable, "-m", "marft_jax.bench.iteration", *argv, "--side", side, "--result", str(result)]
    if not omp_passive:
        cmd.append("--rollout-only")
    if model_dir is not None:
        cmd += ["--model-dir", model_dir]
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    if omp_passive:
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # torch's spinning OpenMP threads collapse on a shared CPU
    else:
        env.pop("OMP_WAIT_POLICY", None)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return cmd, env


def run_sides(sides: Sequence[str], argv: Sequence[str], model_dir: str | None, *, concurrent: bool,
              omp_probe: bool = False) -> dict:
    """Each side in a fresh interpreter (its own peak RSS), one after the other (or all at once
    with ``concurrent``: smoke tests only, the sides then share the CPU); JSON through files.
    ``omp_probe``: after the reference, its rollout once more without ``OMP_WAIT_POLICY=PASSIVE``
    (result key ``reference_omp_probe``)."""
    runs = [(side, side, True) for side in sides]
    if omp_probe and "reference" in sides:
        runs.append(("reference_omp_probe", "reference", False))
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        for name, side, passive in runs:
            result = Path(tmp) / f"{name}.json"
            cmd, env = _side_command(side, argv, model_dir, result, omp_passive=passive)
            proc = subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=sys.stderr, stderr=sys.stderr)
            if not concurrent:
                proc.wait()
            jobs.append((name, cmd, proc, result))
        out = {}
        for name, cmd, proc, result in jobs:
            if proc.wait() != 0 or not result.is_file():
                raise RuntimeError(f"the {name} side failed (exit status {proc.returncode}): {' '.join(cmd)}")
            out[name] = json.loads(result.read_text())
        return out


def keep_faster_rollout(ref: dict, probe: dict) -> None:
    """Keep the faster of the reference's rollout with ``OMP_WAIT_POLICY=PASSIVE`` (``ref``) and
    without (``probe``, a rollout-only run), so the ratio does not flatter us; both are recorded.
    The probe's time replaces the rollout stage only where it played the same env steps."""
    st = ref["stages"]["rollout"]
    label = lambda r: r.get("omp_wait_policy") or "unset"
    ref["rollout_s_by_omp_wait_policy"] = {label(ref): st["s"], label(probe): probe["rollout_s"]}
    ref["rollout_omp_wait_policy"] = label(ref)
    if probe["rollout_s"] < st["s"] and probe["env_steps"] == ref["env_steps"]:
        ref["s"] += probe["rollout_s"] - st["s"]
        ref["s_per_env_step"] = ref["s"] / ref["env_steps"]
        st.update(_stage(probe["rollout_s"], st["valid_tokens"], st["computed_tokens"], st["flops"],
                         ref["matmul_roofline_flops_per_s"]))
        ref["rollout_omp_wait_policy"] = label(probe)


# the floor's stages -> the measured stage holding them
_FLOOR_OF_STAGE = {"rollout": ("prefill", "decode"), "values_logprobs_backup": ("critic_features",),
                   "update": ("update",)}


def add_floors(results: dict) -> dict:
    """Each side's ``floor_s`` (its own trajectory's minimal work, :mod:`marft_jax.bench.floor`,
    at the best roofline and read bandwidth any side measured in this run) and ``over_floor``
    (measured / floor) per floor stage, the rollout and the iteration; the stages get
    ``floor_s`` / ``over_floor`` too. Returns the report's ``floor`` entry."""
    from marft_jax.bench import floor

    roof = max(r["matmul_roofline_flops_per_s"] for r in results.values())
    bw = max(r["read_bandwidth_bytes_per_s"] for r in results.values())
    out = {"roofline_flops_per_s": roof, "read_bytes_per_s": bw,
           "model": "per stage max(flops / roofline, bytes / read bandwidth); the iteration is the sum "
                    "(docs/benchmarks.md, 'The floor')"}
    for side, r in results.items():
        fl = floor.floor_seconds(r["floor_work"], roof, bw)
        measured = {"iteration": r["s"]}
        for stage, parts in _FLOOR_OF_STAGE.items():
            f = sum(fl[p] for p in parts)
            st = r["stages"][stage]
            st["floor_s"], st["over_floor"] = f, st["s"] / f if f > 0 else None
            measured["rollout" if stage == "rollout" else parts[0]] = st["s"]
        fl["rollout"] = fl["prefill"] + fl["decode"]
        for part, s in (r.get("rollout_split_s") or {}).items():
            if s is not None:
                measured[part] = s
        r["floor_s"] = fl
        r["over_floor"] = {k: s / fl[k] if fl[k] > 0 else None for k, s in measured.items()}
        out[side] = fl
    return out


def _strip_side_args(argv: Sequence[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--side", "--result", "--model-dir"):
            skip = True
            continue
        if a == "--rollout-only":
            continue
        if a.startswith(("--side=", "--result=", "--model-dir=")):
            continue
        out.append(a)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="marft-jax bench iteration", description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="reference", choices=["reference", "long", "tiny"])
    p.add_argument("--no-eos", action="store_true", help="no stop tokens on either side (every response "
                                                         "runs to the token budget)")
    p.add_argument("--warmup", type=int, default=1, help="our warm-up iterations before the measured one (>= 1)")
    p.add_argument("--rows", type=int, default=None, help="override rollout.rows (reduced runs)")
    p.add_argument("--horizon", type=int, default=None, help="override rollout.horizon")
    p.add_argument("--new-tokens", type=int, default=None, help="override rollout.max_new_tokens")
    p.add_argument("--math-path", default=str(DEFAULT_MATH), help="MATH training problems (JSON)")
    p.add_argument("--roofline-n", type=int, default=2048, help="matmul size of the roofline")
    p.add_argument("--torch-threads", type=int, default=None, help="torch threads (default: os.cpu_count())")
    p.add_argument("--bandwidth-mib", type=int, default=256, help="array size of the read-bandwidth measurement")
    p.add_argument("--reference-omp", choices=["best", "passive"], default="best",
                   help="best: also time the reference's rollout without OMP_WAIT_POLICY=PASSIVE and keep "
                        "the faster; passive: PASSIVE only")
    p.add_argument("--sides", default="ours,reference", help="which sides to run, in order")
    p.add_argument("--concurrent-sides", action="store_true",
                   help="run the sides at the same time (smoke tests only: their timings then interfere)")
    p.add_argument("--side", choices=["ours", "reference"], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--rollout-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="extra config overrides key=value (both sides)")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.warmup < 1 and args.side != "reference":
        raise SystemExit("--warmup must be >= 1 (the measured iteration must not compile)")
    if args.side is not None:                                             # a child: one side
        if args.workload == "tiny" and args.model_dir is None:
            args.model_dir = str(write_tiny_model(Path(tempfile.mkdtemp(prefix="marft-bench-tiny-"))))
        res = run_ours(args) if args.side == "ours" else run_reference(args)
        text = json.dumps(res)
        if args.result:
            Path(args.result).write_text(text)
        print(text)
        return res

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from marft_jax.bench.machine import cpu_info

    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not set(sides) <= {"ours", "reference"} or not sides:
        raise SystemExit(f"--sides must name ours and/or reference, got {args.sides!r}")
    child_argv = _strip_side_args(argv)
    with tempfile.TemporaryDirectory(prefix="marft-bench-tiny-") as tmp:
        model_dir = str(write_tiny_model(Path(tmp) / "model")) if args.workload == "tiny" else None
        results = run_sides(sides, child_argv, model_dir, concurrent=args.concurrent_sides,
                            omp_probe=args.reference_omp == "best")
    probe = results.pop("reference_omp_probe", None)
    if probe is not None:
        keep_faster_rollout(results["reference"], probe)
    floors = add_floors(results)
    report: dict[str, Any] = {
        "bench": "iteration",
        "workload": args.workload,
        "no_eos": args.no_eos,
        "concurrent_sides": args.concurrent_sides,
        "config_overrides": list(workload(args.workload, math_path=args.math_path, model_dir="<tmp>").overrides)
                            + [f"rollout.rows={args.rows}"] * (args.rows is not None)
                            + [f"rollout.horizon={args.horizon}"] * (args.horizon is not None)
                            + [f"rollout.max_new_tokens={args.new_tokens}"] * (args.new_tokens is not None)
                            + list(args.overrides),
        "env_steps": {k: v["env_steps"] for k, v in results.items()},
        "command": " ".join(["python", "-m", "marft_jax.bench.iteration", *argv]),
        **_git_commit(),
        "machine": {**cpu_info(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_1m_start_end": [load_start, os.getloadavg()[0] if hasattr(os, "getloadavg") else None]},
        **results,
    }
    if "ours" in results and "reference" in results:
        o, r = results["ours"], results["reference"]
        report["ratio_per_env_step"] = r["s_per_env_step"] / o["s_per_env_step"]
        report["ratio_per_stage"] = {k: (r["stages"][k]["s"] / r["env_steps"]) / (o["stages"][k]["s"] / o["env_steps"])
                                     for k in STAGES}
    report["floor"] = floors
    for side, r in results.items():
        report[f"{side}_over_floor"] = r["over_floor"]
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
