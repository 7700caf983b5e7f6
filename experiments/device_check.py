"""One device check: what marft_jax does on the accelerator it runs on, as one JSON object.

Run it on a lent GPU/TPU machine from the checkout, with whatever jax / transformers / torch that
machine has (nothing is installed)::

    PYTHONPATH=. python experiments/device_check.py            # <= 8 minutes on one chip
    PYTHONPATH=. python experiments/device_check.py --small    # CPU smoke check, ~30 s (CI)

Parts (each runs on its own; one that needs a missing package or fails is reported as null
with the reason next to it, ``<field>_reason``, and the others still run):

* ``device_kind``, ``device_count``, ``backend``, ``versions`` (jax, jaxlib, flax, optax,
  transformers, torch, numpy: what was found);
* ``attention``: ``model.attention=auto``'s choice on this backend, checked against the XLA
  implementation (``attention_max_abs_diff``);
* ``parity_kl``: SmolLM2-135M logits on the device in its default dtype (bf16 on GPU/TPU)
  against float32 on the CPU, mean and max per-token KL (``--small``: a random tiny model);
* ``sampler``: per model (SmolLM2-135M; a random Qwen2.5-1.5B-shaped model) and batch (64, 256):
  generated ``tokens_per_s`` of a whole call (prefill included), ``decode_tokens_per_s``, and
  the decode's ``hbm_bw_fraction`` (bytes a step must read: weights + the K/V slots, over the
  device's peak bandwidth);
* ``update_mfu``: one PPO update step (one agent, 8 rows x 2048 tokens: 1920 context + 128
  action, cached critic features) timed after its compile, model FLOPs (forward + activation
  gradients: twice the blocks' FLOPs of every token and the LM head's at the action tokens)
  over the device's peak FLOP/s (``update_s``, ``update_tokens``);
* ``iteration_s``: one whole training iteration on the ``long`` workload (MATH problems, 8 rows,
  512 new tokens, the dual team; the generated arithmetic task with the same shape when the
  MATH file is absent: ``iteration_workload`` says which) after a warm-up iteration;
* ``peak_device_memory_bytes``: the device's peak bytes in use after all parts (null on CPU).

``--small`` (CPU, CI: ~30 s on a busy 2-core box) keeps every field with tiny random models and
shapes, one sampler batch (4), host-drawn random weights, one prompt bucket in the iteration, and
compiles at XLA's backend optimisation level 0 (``xla_flags``): compiling is most of such a run,
and its throughput / MFU figures are smoke values, not measurements.

Peaks: :mod:`marft_jax.train.peaks` (datasheet table, or measured on an unknown device / CPU:
``peak_source``). The last stdout line is the JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # runs from the checkout (PYTHONPATH=. or not)
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

QWEN25_15B_SHAPE = dict(arch="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                        num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                        tie_word_embeddings=True, qkv_bias=True, max_position_embeddings=32768)
TINY_SHAPE = dict(arch="llama", vocab_size=257, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, max_position_embeddings=4096)


def versions() -> dict[str, str | None]:
    out = {}
    for name in ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "chex", "transformers", "torch", "numpy"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception:   # absent or broken: reported, never fatal
            out[name] = None
    return out


class Report(dict):
    """The JSON object; :meth:`part` runs one part and records a failure as null + reason."""

    def part(self, fields: tuple[str, ...], fn: Callable[[], dict]) -> None:
        t0 = time.perf_counter()
        try:
            self.update(fn())
        except Exception as e:   # a part that cannot run on this machine must not sink the others
            reason = f"{type(e).__name__}: {e}"
            for f in fields:
                self[f] = None
                self[f + "_reason"] = reason[:400]
            print(f"[device_check] {fields[0]} failed:\n{traceback.format_exc()}", file=sys.stderr)
        print(f"[device_check] {fields[0]}: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)


SMALL_XLA_FLAG = "--xla_backend_optimization_level=0"


def small_compile_flags() -> None:
    """``--small``: compile without the backend's (LLVM's) optimisation passes. Compiling is most
    of a run with tiny shapes (~2x faster at level 0); the figures of a smoke check are not
    worth optimised code. Only when ``XLA_FLAGS`` names no level, and only before the backend
    starts (``XLA_FLAGS`` is read once, at the first ``jax.devices()``)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {SMALL_XLA_FLAG}".strip()


def default_dtype():
    from marft_jax.models.registry import default_dtype as d
    return d()


def part_attention(small: bool) -> dict:
    from marft_jax.models import attention

    impl = attention.resolve("auto", dtype=default_dtype())
    b, t, h, kv, d = (2, 128, 4, 2, 16) if small else (4, 1024, 16, 4, 128)
    dt = default_dtype()
    if small:   # host random numbers: no compile per shape
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.standard_normal(s), dt) for s in ((b, t, h, d), (b, kv, t, d), (b, kv, t, d)))
    else:
        ks = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(ks[0], (b, t, h, d), dt)
        k = jax.random.normal(ks[1], (b, kv, t, d), dt)
        v = jax.random.normal(ks[2], (b, kv, t, d), dt)
    seg = jnp.concatenate([jnp.ones((b, t // 2), jnp.int32), 2 * jnp.ones((b, t // 2), jnp.int32)], 1)
    ref = jax.jit(lambda *a: attention.segment_attention(*a, impl="xla"))(q, k, v, seg)
    got = jax.jit(lambda *a: attention.segment_attention(*a, impl=impl))(q, k, v, seg)
    diff = float(jnp.max(jnp.abs(ref.astype(jnp.float32) - got.astype(jnp.float32))))
    return {"attention": impl, "attention_max_abs_diff": diff}


def _tiny_cfg():
    from marft_jax.models.config import ModelConfig
    return ModelConfig(**TINY_SHAPE)


def _tiny_params(std: float = 0.02, dtype=jnp.float32):
    """:func:`marft_jax.models.decoder.init_params`'s tree for the tiny model, drawn on the host
    (norm weights 1, the rest ``std`` x normal): the jitted draws compile once per shape, which
    is seconds of a ``--small`` run."""
    from marft_jax.models import decoder

    cfg, rng = _tiny_cfg(), np.random.default_rng(0)
    shapes = jax.eval_shape(lambda k: decoder.init_params(k, cfg, dtype=dtype, std=std), jax.random.key(0))
    draw = lambda path, s: (np.ones(s.shape) if "norm" in jax.tree_util.keystr(path)
                            else std * rng.standard_normal(s.shape)).astype(s.dtype)
    return jax.device_put(jax.tree_util.tree_map_with_path(draw, shapes))


def _init_state(key, cfg, lora_cfg, num_agents: int, optim, jit: bool):
    """:func:`marft_jax.rl.state.init_train_state` (``jit``: one compile instead of one per draw)."""
    from marft_jax.rl.state import init_train_state

    init = lambda k: init_train_state(k, cfg, lora_cfg, num_agents, optim)
    return (jax.jit(init) if jit else init)(key)


def _smollm2():
    from marft_jax.models.registry import load_model
    return load_model("smollm2-135m", dtype=jnp.float32)


def part_parity(small: bool) -> dict:
    from marft_jax.models import decoder

    if small:
        cfg, params = _tiny_cfg(), _tiny_params(std=0.1)
        tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 32)).astype(np.int32)
        model = "tiny-random"
    else:
        m = _smollm2()
        cfg, params = m.cfg, m.params
        ids = [m.tokenizer(t)["input_ids"] for t in ("The capital of France is", "def fibonacci(n):\n",
                                                    "Solve 3x + 5 = 20 for x. The answer is")]
        width = max(map(len, ids))
        tokens = np.array([[0] * (width - len(r)) + r for r in ids], np.int32)
        model = "smollm2-135m"
    lengths = [tokens.shape[1]] * tokens.shape[0] if small else [len(r) for r in ids]
    valid = np.arange(tokens.shape[1])[None] >= tokens.shape[1] - np.asarray(lengths)[:, None]
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        ref = np.asarray(decoder.logits_fn(jax.device_put(params, cpu), tokens, valid, cfg=cfg), np.float64)
    dev = jax.devices()[0]
    dp = jax.device_put(decoder.cast_params(params, default_dtype()), dev)
    got = np.asarray(decoder.logits_fn(dp, jax.device_put(tokens, dev), jax.device_put(valid, dev), cfg=cfg),
                     np.float64)
    p = ref[valid] - np.logaddexp.reduce(ref[valid], axis=-1, keepdims=True)
    q = got[valid] - np.logaddexp.reduce(got[valid], axis=-1, keepdims=True)
    kl = (np.exp(p) * (p - q)).sum(-1)
    return {"parity_kl": float(kl.mean()), "parity_kl_max": float(kl.max()), "parity_model": model,
            "parity_dtype": str(jnp.dtype(default_dtype()))}


def _sampler_point(cfg, params, batch: int, prompt_len: int, new_tokens: int) -> dict:
    from marft_jax.sampling.sampler import Sampler, SamplingConfig
    from marft_jax.train import peaks

    sampler = Sampler(cfg, pad_id=0, stop_ids=())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
    conf = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0)
    sampler(params, prompts, key=jax.random.key(0), config=conf)          # compile
    sampler.take_totals()
    t0 = time.perf_counter()
    out = sampler(params, prompts, key=jax.random.key(1), config=conf)
    wall = time.perf_counter() - t0
    tot = sampler.take_totals()
    peak = peaks.device_peak()
    generated = int(np.asarray(out.lengths).sum())
    return {"tokens_per_s": generated / wall, "decode_tokens_per_s": tot.decode_row_steps / max(tot.decode_s, 1e-9),
            "hbm_bw_fraction": tot.decode_bytes / max(tot.decode_s, 1e-9) / peak.hbm_bytes_per_s,
            "prefill_s": tot.prefill_s, "decode_s": tot.decode_s, "prompt_len": prompt_len, "new_tokens": new_tokens}


def part_sampler(small: bool) -> dict:
    from marft_jax.models import decoder
    from marft_jax.models.config import ModelConfig

    out: dict[str, Any] = {}
    if small:
        cfg = _tiny_cfg()
        models = {"tiny-random": (cfg, _tiny_params)}
        batches, plen, new = (4,), 16, 16       # one batch: each batch size compiles its own sampler
    else:
        qcfg = ModelConfig(**QWEN25_15B_SHAPE)
        models = {"smollm2-135m": (None, None),
                  "qwen2.5-1.5b-shape-random": (qcfg, lambda: decoder.init_params(jax.random.key(0), qcfg,
                                                                                  dtype=default_dtype()))}
        batches, plen, new = (64, 256), 128, 128
    for name, (cfg, make) in models.items():
        try:
            if cfg is None:
                m = _smollm2()
                cfg, params = m.cfg, decoder.cast_params(m.params, default_dtype())
            else:
                params = make()
            params = jax.device_put(params, jax.devices()[0])
            out[name] = {str(b): _sampler_point(cfg, params, b, plen, new) for b in batches}
            del params
        except Exception as e:   # e.g. the embedded model package is absent on this machine
            out[name] = None
            out[name + "_reason"] = f"{type(e).__name__}: {e}"[:400]
    return {"sampler": out}


def part_update(small: bool) -> dict:
    from marft_jax.bench.update import SMOLLM2_135M_SHAPE
    from marft_jax.models import decoder
    from marft_jax.models.config import ModelConfig
    from marft_jax.config import LoraConfig, OptimConfig, PPOConfig
    from marft_jax.rl.update import UpdateBatch, UpdateConfig, ppo_update
    from marft_jax.train import peaks

    cfg = _tiny_cfg() if small else ModelConfig(**SMOLLM2_135M_SHAPE)
    rows, ctx, act = (2, 48, 16) if small else (8, 1920, 128)
    params = (_tiny_params(dtype=default_dtype()) if small
              else decoder.init_params(jax.random.key(0), cfg, dtype=default_dtype()))
    state = _init_state(jax.random.key(1), cfg, LoraConfig(rank=8), 1, OptimConfig(), jit=small)
    rng = np.random.default_rng(0)
    shape = (1, rows, 1)
    av = np.ones(shape + (act,), bool)
    batch = UpdateBatch(
        ctx_tokens=jnp.asarray(rng.integers(3, cfg.vocab_size, shape + (ctx,)), jnp.int32),
        ctx_valid=jnp.ones(shape + (ctx,), bool),
        act_tokens=jnp.asarray(rng.integers(3, cfg.vocab_size, shape + (act,)), jnp.int32),
        act_valid=jnp.asarray(av), logp_old=jnp.full(shape + (act,), -3.0), adv=jnp.asarray(rng.normal(size=shape)),
        ret=jnp.asarray(rng.normal(size=shape)), v_old=jnp.zeros(shape), dp_mask=jnp.ones(shape, bool),
        feats=jnp.zeros(shape + (cfg.hidden_size,)), word_count=jnp.full(shape, act, jnp.int32))
    ucfg = UpdateConfig(ppo=PPOConfig(kl_stop=None, happo_weighting=False))
    mask, flag = jnp.ones((1,), bool), jnp.asarray(True)
    state, _ = ppo_update(params, state, batch, mask, flag, cfg=cfg, ucfg=ucfg)   # compile
    jax.block_until_ready(state.lora)
    t0 = time.perf_counter()
    state, _ = ppo_update(params, state, batch, mask, flag, cfg=cfg, ucfg=ucfg)
    jax.block_until_ready(state.lora)
    secs = time.perf_counter() - t0
    tokens = rows * (ctx + act)
    head = 2.0 * cfg.hidden_size * cfg.vocab_size          # logits only at the action positions
    flops = 2.0 * ((cfg.flops_per_token((ctx + act) // 2) - head) * tokens + head * rows * act)
    peak = peaks.device_peak()
    return {"update_mfu": flops / secs / peak.flops(default_dtype()), "update_s": secs, "update_tokens": tokens,
            "peak_source": peak.source}


def part_iteration(small: bool, math_path: Path) -> dict:
    from marft_jax.bench import iteration as bench_it
    from marft_jax.config import load_config
    from marft_jax.train.build import build_run

    with contextlib.ExitStack() as stack:
        if small:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            wl = bench_it.workload("tiny", math_path=str(math_path), model_dir=str(bench_it.write_tiny_model(tmp / "m")))
            name = "tiny"
        elif math_path.exists():
            wl, name = bench_it.workload("long", math_path=str(math_path)), "long"
        else:   # the long workload's shape on the generated task
            wl = bench_it.Workload("long-arithmetic", bench_it._COMMON + (
                "model.name=smollm2-135m", "task.name=arithmetic", "team.profile=math/dual", "rollout.rows=8",
                "rollout.horizon=1", "rollout.max_new_tokens=512", "rollout.context_window=2048"))
            name = f"long shape on the arithmetic task ({math_path} absent)"
        # The accelerator defaults, not the CPU benchmark's float32 + full remat.
        cfg = load_config(None, list(wl.overrides) + ["model.dtype=auto", "model.remat=null", "train.out_dir=" +
                                                      stack.enter_context(tempfile.TemporaryDirectory())])
        run = build_run(cfg)
        stack.callback(run.close)
        if small:   # one prompt bucket for both agents' prompts: one sampler compile, not two
            run.learner.sampler.min_prompt_bucket = 128
        state = _init_state(jax.random.key(0), run.model.cfg, cfg.lora, cfg.team.num_agents,
                            cfg.optim, jit=small)
        problems = bench_it.select_problems(run, wl, cfg.rollout.rows) if wl.agent0_context else \
            [p for _, p in zip(range(cfg.rollout.rows), run.task.problems("train", 0))]
        key = jax.random.key(0)
        state, _, _ = run.learner.iteration(state, problems, iteration=0, env_samples=0, key=key)   # warm-up
        t0 = time.perf_counter()
        state, m, _ = run.learner.iteration(state, problems, iteration=1, env_samples=0, key=key)
        secs = time.perf_counter() - t0
    return {"iteration_s": secs, "iteration_workload": name,
            "iteration_stages_s": {k: m[k] for k in ("timing_s/rollout", "timing_s/values_logprobs_backup",
                                                     "timing_s/update") if k in m},
            "iteration_mfu": m.get("perf/mfu"), "iteration_hbm_bw_util": m.get("perf/hbm_bw_util"),
            "iteration_compiles": m.get("perf/compiles")}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny random models, small shapes (CPU, < 1 minute)")
    p.add_argument("--math-path", default=str(ROOT.parent / "shared" / "data" / "math_train.json"))
    p.add_argument("--skip", default="", help="comma-separated parts to skip: attention,parity,sampler,update,iteration")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.small:
        small_compile_flags()
    dev = jax.devices()[0]
    report = Report(device_kind=str(getattr(dev, "device_kind", dev.platform)), device_count=jax.device_count(),
                    backend=jax.default_backend(), small=args.small, versions=versions())
    if args.small:
        report["xla_flags"] = os.environ.get("XLA_FLAGS")
    skip = {s for s in args.skip.split(",") if s}
    parts = [("attention", ("attention", "attention_max_abs_diff"), lambda: part_attention(args.small)),
             ("parity", ("parity_kl",), lambda: part_parity(args.small)),
             ("sampler", ("sampler",), lambda: part_sampler(args.small)),
             ("update", ("update_mfu",), lambda: part_update(args.small)),
             ("iteration", ("iteration_s",), lambda: part_iteration(args.small, Path(args.math_path)))]
    for name, fields, fn in parts:
        if name in skip:
            for f in fields:
                report[f], report[f + "_reason"] = None, "skipped (--skip)"
            continue
        report.part(fields, fn)
    from marft_jax.train import peaks

    report["peak_device_memory_bytes"] = peaks.peak_device_memory_bytes()
    if report["peak_device_memory_bytes"] is None:
        report["peak_device_memory_bytes_reason"] = f"the {jax.default_backend()} backend reports no memory_stats()"
    report["peak_host_rss_bytes"] = peaks.peak_host_rss_bytes()
    report["wall_s"] = time.perf_counter() - t0
    print(json.dumps(report, default=str), flush=True)
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
