"""The device check: what marft_jax does on the accelerator it runs on, in one 10-minute slot.

On a lent GPU/TPU machine, through ``experiments/device_check.sh`` (it installs the few wheels
the machine lacks and sets the budget)::

    experiments/device_check.sh                                     # budget 540 s, JSON lines to a file
    PYTHONPATH=. python experiments/device_check.py --budget-s 540  # the same, by hand
    PYTHONPATH=. python experiments/device_check.py --small         # CPU smoke check (CI, < 60 s)

Nothing is downloaded: the models are random weights of Qwen2.5 shapes
(:mod:`marft_jax.models.known_configs`) and, for parity, a tiny random Hugging Face Qwen2 built
on the spot with ``transformers`` + ``torch``; the tokenizer of the whole-iteration part is a
byte-level one built here.

Output: one JSON line per part on stdout (and in ``--out``) as soon as it ends, so a run killed
later still returns what it measured, then the summary object as the last line. A part line is
``{"part": name, "ok": bool, "seconds": s, "peak_device_memory_bytes": n | null, "result":
{...}}`` (``"reason"`` when it failed or was skipped; ``"partial": true`` when it was stopped
with some of its points measured). Parts, most valuable first (the order they run in):

* ``environment``: backend, device kind and count, versions (jax, jaxlib, the CUDA / TPU
  plugins, CUDA runtime and driver, cuDNN, libtpu's platform version, flax, optax, orbax, chex,
  transformers, torch, numpy, pyarrow, omegaconf), the peak table entry, what
  ``model.attention=auto`` picks for the dtype the weights load in, and
  ``jax.print_environment_info``'s text;
* ``attention``: every implementation available on the backend (``model.attention``) at the
  row lengths a run produces (16, 64, 160, 640, 2048), forward and gradient, against XLA in
  float32 (max abs error over the valid positions) and the time per call; on GPU also the cuDNN
  call with the segment mask (what ``cudnn`` runs) against the packed segment-lengths form
  (``q_offsets`` / ``q_seqlen``, where the installed JAX has it), timed both;
* ``parity``: a tiny random HF Qwen2 (torch, float32, CPU) against our decoder on the device
  in the default dtype with ``auto`` attention: per-token KL and greedy agreement;
* ``sampler``: a random Qwen2.5-1.5B-shaped model, batch 64 and 256, prompts of 128 and 1024
  tokens, 512 new tokens: generated tokens/s of a whole call, decode tokens/s and the decode's
  HBM fraction (bytes a step must read over the peak bandwidth), first call (compile) apart;
* ``update``: one PPO update step on Qwen2.5-0.5B and 1.5B shapes at 8 rows x 2048 tokens
  (1536 context + 512 action), the run's attention, remat chosen from the compiled memory plan
  as a run does (``none``, ``dots_no_batch``, ``full``: the first that fits), median of 3 steps;
  ``mfu`` counts the model's FLOPs, ``hfu`` adds what remat and the chunked head recompute;
* ``iteration``: one whole training iteration of a random Qwen2.5-0.5B-shaped model through
  ``build_run`` (arithmetic task, 8 rows, 512 new tokens, 2 agents), its stage times and
  compiles; a second one when the budget leaves room (steady state).

``--budget-s`` skips a part whose estimated cost no longer fits and stops a part's remaining
points at the budget. Each part runs in its own process by default (``--in-process`` off): its
device memory peak is its own, a part that crashes or hangs is reported and killed at the
budget, and the others still run; the parent never starts a JAX backend. ``--small`` (CPU, CI)
runs tiny shapes in-process at XLA's backend optimisation level 0; its figures are smoke values.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # runs from the checkout (PYTHONPATH=. or not)
    sys.path.insert(0, str(ROOT))

# (name, estimated seconds on one GPU, estimated seconds with --small on a busy 2-core CPU): the
# budget skips a part whose estimate does not fit. GPU figures are estimates (compiles of 28-layer
# programs, 10-20 s each, dominate); they are not measured yet.
PARTS = (("environment", 15, 3), ("attention", 90, 6), ("parity", 30, 6), ("sampler", 180, 8),
         ("update", 150, 8), ("iteration", 180, 15))
ATTENTION_LENGTHS = (16, 64, 160, 640, 2048)
SMALL_ATTENTION_LENGTHS = (16, 64, 160)
SAMPLER_POINTS = ((64, 128), (256, 128), (64, 1024), (256, 1024))   # (batch, prompt tokens), by value
SAMPLER_NEW_TOKENS = 512
UPDATE_MODELS = ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct")
UPDATE_ROWS, UPDATE_CTX, UPDATE_ACT = 8, 1536, 512
SMALL_XLA_FLAG = "--xla_backend_optimization_level=0"
VERSIONED = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt",
             "libtpu", "libtpu-nightly", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "nvidia-cuda-runtime",
             "nvidia-cuda-runtime-cu12", "flax", "optax", "orbax-checkpoint", "chex", "transformers", "torch",
             "numpy", "pyarrow", "omegaconf", "marft-jax")
TINY_HF = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0)


class Budget:
    """Seconds left of ``total`` (None: unlimited) since ``start``."""

    def __init__(self, total: float | None, start: float | None = None):
        self.total, self.start = total, time.monotonic() if start is None else start

    def left(self) -> float:
        return float("inf") if self.total is None else self.total - (time.monotonic() - self.start)

    def fits(self, seconds: float) -> bool:
        return self.left() >= seconds


# ---------------------------------------------------------------------------------------------
# Helpers of the parts (they import jax: only ever called in the process that runs a part).


def _dtype():
    from marft_jax.models.registry import default_dtype
    return default_dtype()


def _peak_memory() -> int | None:
    from marft_jax.train import peaks
    return peaks.peak_device_memory_bytes()


def _model_cfg(name: str, small: bool, attention: str | None = None):
    """A known config's :class:`ModelConfig` (``--small``: :data:`TINY_HF` as a Qwen2 config)."""
    import dataclasses

    from marft_jax.models.config import ModelConfig
    from marft_jax.models.known_configs import hf_config

    hf = tiny_qwen2_config() if small else hf_config(name)
    if hf is None:
        raise KeyError(f"{name} is not in marft_jax.models.known_configs")
    cfg = ModelConfig.from_hf(hf)
    return cfg if attention is None else dataclasses.replace(cfg, attention=attention)


def tiny_qwen2_config() -> dict:
    return {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu",
            "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, **TINY_HF}


def _random_params(cfg, dtype, small: bool, seed: int = 0):
    """Random decoder weights: one jitted draw on the device, or host draws with ``--small`` (a
    jitted draw compiles one program per shape, seconds of a small run)."""
    import jax
    import numpy as np

    from marft_jax.models import decoder

    if not small:
        return jax.jit(lambda k: decoder.init_params(k, cfg, dtype=dtype))(jax.random.key(seed))
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda k: decoder.init_params(k, cfg, dtype=dtype), jax.random.key(0))
    draw = lambda path, s: (np.ones(s.shape) if "norm" in jax.tree_util.keystr(path)
                            else 0.02 * rng.standard_normal(s.shape)).astype(s.dtype)
    return jax.device_put(jax.tree_util.tree_map_with_path(draw, shapes))


def _timed(fn, *args, repeats: int = 5) -> float:
    """Median seconds of ``fn(*args)`` after one warm-up call."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# environment


def _distribution_versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _cuda_versions() -> dict[str, Any]:
    """CUDA runtime / driver, cuDNN, cuBLAS versions as the JAX CUDA plugin reports them."""
    try:
        from jax._src.lib import cuda_versions
    except Exception as e:   # private module: moved or absent
        return {"error": f"{type(e).__name__}: {e}"}
    if cuda_versions is None:
        return {}
    out = {}
    for fn in ("cuda_runtime_get_version", "cuda_driver_get_version", "cudnn_get_version", "cublas_get_version",
               "cufft_get_version", "cusolver_get_version", "cusparse_get_version"):
        try:
            out[fn.replace("_get_version", "")] = getattr(cuda_versions, fn)()
        except Exception:   # a function this plugin lacks
            pass
    return out


def part_environment(small: bool, budget: Budget, emit: Callable[[dict], None]) -> dict:
    import jax

    from marft_jax.models import attention
    from marft_jax.train import peaks

    dev = jax.devices()[0]
    dtype = _dtype()
    try:
        stats = dev.memory_stats() or {}
    except Exception:   # backends without memory stats
        stats = {}
    info = io.StringIO()
    with contextlib.redirect_stdout(info):
        try:
            text = jax.print_environment_info(return_string=True)
        except Exception as e:   # nvidia-smi missing, ...
            text = f"print_environment_info failed: {type(e).__name__}: {e}"
    table = peaks.table_peak(str(getattr(dev, "device_kind", "")))
    return {"backend": jax.default_backend(), "device_kind": str(getattr(dev, "device_kind", dev.platform)),
            "device_count": jax.device_count(), "local_device_count": jax.local_device_count(),
            "process_count": jax.process_count(),
            "platform_version": str(getattr(getattr(dev, "client", None), "platform_version", "")),
            "versions": _distribution_versions(), "cuda": _cuda_versions(),
            "python": sys.version.split()[0], "device_memory_bytes": stats.get("bytes_limit"),
            "peak_table": None if table is None else {"source": table.source, "flops_bf16": table.flops_bf16,
                                                      "flops_f32": table.flops_f32,
                                                      "hbm_bytes_per_s": table.hbm_bytes_per_s},
            "default_dtype": str(jax.numpy.dtype(dtype)),
            "attention_auto": attention.resolve("auto", dtype=dtype),
            "xla_flags": os.environ.get("XLA_FLAGS"), "environment_info": text or info.getvalue()}


# ---------------------------------------------------------------------------------------------
# attention


def _available_attention() -> list[str]:
    from marft_jax.models import attention

    out = []
    for impl in attention.IMPLEMENTATIONS:
        try:
            attention.resolve(impl, dtype=_dtype())
            out.append(impl)
        except attention.AttentionUnavailable:
            pass
    return out


def _segments(rng, rows: int, t: int):
    """``[rows, t]`` segment ids of packed rows: random segments end to end, then ~1/8 padding (0)."""
    import numpy as np

    seg = np.zeros((rows, t), np.int32)
    for r in range(rows):
        pos, sid, end = 0, 1, t - int(rng.integers(0, max(1, t // 8) + 1))
        while pos < end:
            n = int(rng.integers(1, max(2, end - pos) + 1)) if sid < 4 else end - pos
            seg[r, pos:pos + n] = sid
            pos, sid = pos + n, sid + 1
    return seg


def _attention_inputs(t: int, small: bool, dtype, seed: int = 0):
    import jax.numpy as jnp
    import numpy as np

    heads, kv, d = (4, 2, 16) if small else (12, 2, 128)       # Qwen2.5-1.5B's attention
    rows = 2 if small else max(2, 16384 // t)                   # ~16k tokens per call
    rng = np.random.default_rng(seed + t)
    q = rng.standard_normal((rows, t, heads, d)).astype(np.float32)
    k = rng.standard_normal((rows, kv, t, d)).astype(np.float32)
    v = rng.standard_normal((rows, kv, t, d)).astype(np.float32)
    g = rng.standard_normal((rows, t, heads, d)).astype(np.float32)   # output cotangent
    seg = _segments(rng, rows, t)
    g = g * (seg > 0)[:, :, None, None]                               # padding rows carry no gradient
    f32 = tuple(jnp.asarray(x) for x in (q, k, v, g))
    return f32, tuple(x.astype(dtype) for x in f32), jnp.asarray(seg)


def _attention_fns(call):
    """(forward, forward + gradient) of ``call(q, k, v, seg)``, jitted."""
    import jax
    import jax.numpy as jnp

    fwd = jax.jit(call)

    def loss(q, k, v, seg, g):
        return jnp.sum(call(q, k, v, seg).astype(jnp.float32) * g.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return fwd, grad


def _max_err(got, ref, seg) -> float:
    """Max abs error over the valid (non-padding) query positions (padding outputs are unspecified)."""
    import numpy as np

    diff = np.abs(np.asarray(got, np.float32) - np.asarray(ref, np.float32))
    return float(diff[np.asarray(seg > 0)].max())


def _grad_err(got, ref) -> float:
    """Max abs error of the (dq, dk, dv) gradients over the largest reference magnitude."""
    import numpy as np

    scale = max(float(np.abs(np.asarray(r, np.float32)).max()) for r in ref) or 1.0
    return max(float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())
               for a, b in zip(got, ref)) / scale


def packed_lengths_offsets(seg, m: int):
    """cuDNN's packed layout of ``[B, T]`` segment ids (segments ``1..n`` end to end, in order;
    0 = padding): ``q_seqlen`` ``[B, m]`` (each segment's length, -1 past the last) and
    ``q_offsets`` ``[B, m + 1]`` (each segment's start, then the end of the last, then -1)."""
    import jax.numpy as jnp

    b = seg.shape[0]
    hit = seg[:, None, :] == jnp.arange(1, m + 1, dtype=seg.dtype)[None, :, None]       # [B, m, T]
    lengths = jnp.sum(hit, axis=-1).astype(jnp.int32)
    starts = jnp.argmax(hit, axis=-1).astype(jnp.int32)
    present = lengths > 0
    offsets = jnp.concatenate([jnp.where(present, starts, -1), jnp.full((b, 1), -1, jnp.int32)], axis=1)
    end = jnp.max(jnp.where(present, starts + lengths, 0), axis=1)
    offsets = offsets.at[jnp.arange(b), jnp.sum(present, axis=1)].set(end)
    return jnp.where(present, lengths, -1), offsets


def _cudnn_packed_call():
    """The cuDNN call with packed segment lengths and offsets (``q_seqlen`` ``[B, M]``,
    ``q_offsets`` ``[B, M+1]``, causal mask type): no dense mask. JAX's private
    ``fused_attention_stablehlo`` API (its public ``dot_product_attention`` takes right-padding
    lengths only). None where the installed JAX lacks it."""
    import inspect

    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except Exception:   # private module moved
        return None
    if "q_offsets" not in inspect.signature(fa.dot_product_attention).parameters:
        return None
    import jax.numpy as jnp

    def call(q, k, v, seg):
        seqlen, offsets = packed_lengths_offsets(seg, min(seg.shape[1], 16))   # _segments makes <= 4
        out = fa.dot_product_attention(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), q_seqlen=seqlen,
                                       kv_seqlen=seqlen, q_offsets=offsets, kv_offsets=offsets,
                                       scale=1.0 / float(q.shape[-1]) ** 0.5, mask_type=fa.MaskType.PADDING_CAUSAL)
        return out.astype(q.dtype)
    return call


def part_attention(small: bool, budget: Budget, emit: Callable[[dict], None]) -> dict:
    import jax
    import jax.numpy as jnp

    from marft_jax.models import attention

    dtype = _dtype()
    impls = _available_attention()
    lengths = SMALL_ATTENTION_LENGTHS if small else ATTENTION_LENGTHS
    calls = {impl: (lambda q, k, v, s, impl=impl: attention.segment_attention(q, k, v, s, impl=impl)) for impl in impls}
    if "cudnn" in impls:
        packed = _cudnn_packed_call()
        if packed is not None:
            calls["cudnn_packed_lengths"] = packed
    ref_call = lambda q, k, v, s: attention.segment_attention(q, k, v, s, impl="xla")
    out: dict[str, Any] = {"implementations": list(calls), "dtype": str(jnp.dtype(dtype)),
                           "auto": attention.resolve("auto", dtype=dtype), "lengths": {}}
    per_length = 3.0 * len(calls) if small else 6.0 * len(calls)
    for t in lengths:
        if not budget.fits(per_length):
            out["stopped"] = f"budget: lengths from {t} not run"
            break
        f32, args, seg = _attention_inputs(t, small, dtype)
        ref_fwd, ref_grad = _attention_fns(ref_call)
        with jax.default_matmul_precision("highest"):     # no TF32 / bf16 passes in the reference
            ref_o = ref_fwd(*f32[:3], seg)
            ref_g = ref_grad(*f32[:3], seg, f32[3])
        row: dict[str, Any] = {"rows": int(seg.shape[0])}
        for name, call in calls.items():
            try:
                fwd, grad = _attention_fns(call)
                o = fwd(*args[:3], seg)
                g = grad(*args[:3], seg, args[3])
                row[name] = {"fwd_max_abs_err": _max_err(o, ref_o, seg), "grad_rel_err": _grad_err(g, ref_g),
                             "fwd_ms": 1e3 * _timed(fwd, *args[:3], seg, repeats=3 if small else 10),
                             "fwd_grad_ms": 1e3 * _timed(grad, *args[:3], seg, args[3], repeats=3 if small else 10)}
            except Exception as e:   # a kernel that rejects this length or is missing here
                row[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
        out["lengths"][str(t)] = row
        emit(out)
    return out


# ---------------------------------------------------------------------------------------------
# parity


def part_parity(small: bool, budget: Budget, emit: Callable[[dict], None]) -> dict:
    """A tiny random HF Qwen2 (float32, torch on the CPU) against ours on the device."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from marft_jax.models import attention, decoder
    from marft_jax.models.config import ModelConfig
    from marft_jax.models.weights import params_from_state_dict

    torch.manual_seed(0)
    hf_cfg = Qwen2Config(tie_word_embeddings=False, pad_token_id=0, **TINY_HF)
    model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():   # non-trivial norms and biases, so parity covers them
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else
                    0.1 * torch.randn_like(p) if name.endswith("bias") else 0.08 * torch.randn_like(p))
    rng = np.random.default_rng(0)
    lengths = np.array([48, 31, 64, 17])
    total = int(lengths.max())
    tokens = np.zeros((len(lengths), total), np.int32)
    valid = np.arange(total)[None] >= total - lengths[:, None]       # left-padded, as prompts are
    tokens[valid] = rng.integers(3, TINY_HF["vocab_size"], int(valid.sum()))
    pos = np.clip(np.cumsum(valid, 1) - 1, 0, None)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens.astype(np.int64)),
                    attention_mask=torch.from_numpy(valid.astype(np.int64)),
                    position_ids=torch.from_numpy(pos.astype(np.int64))).logits.double().numpy()
    dtype = _dtype()
    impl = attention.resolve("auto", dtype=dtype)
    cfg = dataclasses.replace(ModelConfig.from_hf(hf_cfg), attention=impl)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params_from_state_dict(cfg, sd, source="tiny-hf-qwen2"))
    got = np.asarray(jax.jit(lambda p, t, v: decoder.logits_fn(p, t, v, cfg=cfg))(params, tokens, valid), np.float64)
    p = ref[valid] - np.logaddexp.reduce(ref[valid], axis=-1, keepdims=True)
    q = got[valid] - np.logaddexp.reduce(got[valid], axis=-1, keepdims=True)
    kl = (np.exp(p) * (p - q)).sum(-1)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "greedy_agreement": float((p.argmax(-1) == q.argmax(-1)).mean()), "dtype": str(jnp.dtype(dtype)),
            "attention": impl, "model": "tiny random HF Qwen2 (transformers, float32 CPU reference)"}


# ---------------------------------------------------------------------------------------------
# sampler


def part_sampler(small: bool, budget: Budget, emit: Callable[[dict], None]) -> dict:
    import jax
    import numpy as np

    from marft_jax.models import attention
    from marft_jax.sampling.sampler import Sampler, SamplingConfig
    from marft_jax.train import peaks

    dtype = _dtype()
    name = "Qwen/Qwen2.5-1.5B-Instruct"
    cfg = _model_cfg(name, small, attention.resolve("auto", dtype=dtype))
    params = _random_params(cfg, dtype, small)
    points = ((4, 16),) if small else SAMPLER_POINTS
    new = 16 if small else SAMPLER_NEW_TOKENS
    peak = peaks.device_peak()
    out: dict[str, Any] = {"model": "tiny random Qwen2" if small else f"random {name} shape",
                           "new_tokens": new, "attention": cfg.attention, "peak_source": peak.source, "points": {}}
    est = 4.0 if small else 45.0
    for batch, plen in points:
        if not budget.fits(est):
            out["stopped"] = f"budget: batch {batch} x prompt {plen} and later points not run"
            break
        sampler = Sampler(cfg, pad_id=0, stop_ids=(), max_prompt_len=plen)
        rng = np.random.default_rng(batch + plen)
        prompts = [rng.integers(3, cfg.vocab_size, plen).tolist() for _ in range(batch)]
        conf = SamplingConfig(max_new_tokens=new, temperature=1.0)
        t0 = time.perf_counter()
        sampler(params, prompts, key=jax.random.key(0), config=conf)           # compiles
        first = time.perf_counter() - t0
        sampler.take_totals()
        t0 = time.perf_counter()
        res = sampler(params, prompts, key=jax.random.key(1), config=conf)
        wall = time.perf_counter() - t0
        tot = sampler.take_totals()
        generated = int(np.asarray(res.lengths).sum())
        out["points"][f"b{batch}_p{plen}"] = {
            "batch": batch, "prompt_tokens": plen, "first_call_s": first, "wall_s": wall,
            "tokens_per_s": generated / wall, "prefill_s": tot.prefill_s, "decode_s": tot.decode_s,
            "decode_tokens_per_s": tot.decode_row_steps / max(tot.decode_s, 1e-9),
            "decode_hbm_fraction": tot.decode_bytes / max(tot.decode_s, 1e-9) / peak.hbm_bytes_per_s,
            "peak_device_memory_bytes": _peak_memory()}
        est = max(est, 1.2 * (first + wall))
        emit(out)
    return out


# ---------------------------------------------------------------------------------------------
# update


def _update_batch(cfg, rows: int, ctx: int, act: int):
    import jax.numpy as jnp
    import numpy as np

    from marft_jax.rl.update import UpdateBatch

    rng = np.random.default_rng(0)
    shape = (1, rows, 1)
    return UpdateBatch(
        ctx_tokens=jnp.asarray(rng.integers(3, cfg.vocab_size, shape + (ctx,)), jnp.int32),
        ctx_valid=jnp.ones(shape + (ctx,), bool),
        act_tokens=jnp.asarray(rng.integers(3, cfg.vocab_size, shape + (act,)), jnp.int32),
        act_valid=jnp.ones(shape + (act,), bool), logp_old=jnp.full(shape + (act,), -3.0),
        adv=jnp.asarray(rng.normal(size=shape), jnp.float32), ret=jnp.asarray(rng.normal(size=shape), jnp.float32),
        v_old=jnp.zeros(shape), dp_mask=jnp.ones(shape, bool), feats=jnp.zeros(shape + (cfg.hidden_size,)),
        word_count=jnp.full(shape, act, jnp.int32))


def update_flops(cfg, rows: int, ctx: int, act: int, remat: str) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one update step of one agent: the loss forward (blocks
    over ``ctx + act`` tokens, the head at the ``act`` positions) and its input gradients (1x the
    blocks, the base is frozen; 1x the head); hardware adds the chunked head's recomputed forward
    and remat's recompute (``full``: the blocks' forward again; ``dots_no_batch``: the
    attention score products; ``none``: nothing)."""
    from marft_jax.bench.update import _body_flops, _head_flops

    t = ctx + act
    body, head = _body_flops(cfg, rows, t), _head_flops(cfg, rows * act)
    attn = rows * t * cfg.num_layers * 2.0 * cfg.q_size * (t // 2) * 2
    recompute = {"full": body, "dots_no_batch": attn}.get(remat, 0.0)
    return 2 * body + 2 * head, 2 * body + 3 * head + recompute


def _update_point(name: str, small: bool) -> dict:
    import dataclasses

    import jax
    import jax.numpy as jnp

    from marft_jax.config import LoraConfig, OptimConfig, PPOConfig
    from marft_jax.models import attention, decoder
    from marft_jax.rl.state import init_train_state
    from marft_jax.rl.update import UpdateConfig, ppo_update
    from marft_jax.train import memory_plan, peaks

    dtype = _dtype()
    cfg = _model_cfg(name, small, attention.resolve("auto", dtype=dtype))
    rows, ctx, act = (2, 48, 16) if small else (UPDATE_ROWS, UPDATE_CTX, UPDATE_ACT)
    params = _random_params(cfg, dtype, small)
    state = jax.jit(lambda k: init_train_state(k, cfg, LoraConfig(rank=8), 1, OptimConfig()))(jax.random.key(1))
    batch = _update_batch(cfg, rows, ctx, act)
    base = UpdateConfig(ppo=PPOConfig(kl_stop=None, happo_weighting=False))
    args = (params, state, batch, jnp.ones((1,), bool), jnp.asarray(True))
    # As TeamLearner.check_update_memory: on an accelerator the least recompute that fits.
    policies = [None] if jax.default_backend() == "cpu" else ["none", "dots_no_batch", "full"]
    available = memory_plan.available_bytes()
    plans, compiled, compile_s, chosen = {}, None, 0.0, None
    for policy in policies:
        ucfg = dataclasses.replace(base, remat=policy)
        t0 = time.perf_counter()
        compiled = ppo_update.lower(*args, cfg=cfg, ucfg=ucfg).compile()
        compile_s += time.perf_counter() - t0
        planned = memory_plan.planned_bytes(compiled)
        plans[str(policy or "auto")] = planned
        chosen = policy
        if planned is None or planned <= available:
            break
    remat = decoder.resolve_remat(chosen, ctx + act)
    times = []
    for i in range(4):          # the first (buffers, autotuned kernels loading) untimed
        t0 = time.perf_counter()
        state, metrics = compiled(params, state, batch, *args[3:])
        jax.block_until_ready((state, metrics))
        if i:
            times.append(time.perf_counter() - t0)
    secs = statistics.median(times)
    model_flops, hw_flops = update_flops(cfg, rows, ctx, act, remat)
    peak = peaks.device_peak()
    pf = peak.flops(dtype)
    return {"model": f"random {name} shape" if not small else "tiny random Qwen2", "rows": rows,
            "tokens_per_row": ctx + act, "attention": cfg.attention, "remat": remat, "planned_bytes": plans,
            "available_bytes": available, "compile_s": compile_s, "step_s": secs, "steps_s": times,
            "mfu": model_flops / secs / pf, "hfu": hw_flops / secs / pf, "model_flops": model_flops,
            "hardware_flops": hw_flops, "peak_source": peak.source, "peak_device_memory_bytes": _peak_memory()}


def part_update(small: bool, budget: Budget, emit: Callable[[dict], None]) -> dict:
    out: dict[str, Any] = {"models": {}}
    est = 4.0 if small else 60.0
    for name in UPDATE_MODELS[:1] if small else UPDATE_MODELS:
        if not budget.fits(est):
            out["stopped"] = f"budget: {name} not run"
            break
        t0 = time.perf_counter()
        out["models"][name] = _update_point(name, small)
        est = max(est, 2.0 * (time.perf_counter() - t0))     # the next model is larger
        emit(out)
    return out


# ---------------------------------------------------------------------------------------------
# iteration


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_level_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer without merges (one token per byte), the three Qwen chat tokens
    and filler tokens up to ``vocab_size`` (what a random model samples decodes to something),
    with a ChatML template: a stand-in for a real tokenizer that needs no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(sorted(alphabet))}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[f"~{i}"] = i
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, chat_template=CHAT_TEMPLATE)


def write_random_model(root: Path, hf: dict, dtype: str, seed: int = 0) -> Path:
    """``config.json``, random ``model.safetensors`` (``dtype``: ``float32`` or ``bfloat16``)
    and :func:`byte_level_tokenizer` in ``root``: a Hugging Face model directory ``build_run``
    loads like a downloaded one."""
    import torch
    from safetensors.torch import save_file

    from marft_jax.models.config import ModelConfig
    from marft_jax.models.weights import expected_shapes

    root.mkdir(parents=True, exist_ok=True)
    tok = byte_level_tokenizer(hf["vocab_size"])
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    hf = {**hf, "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
          "pad_token_id": ids["<|endoftext|>"], "torch_dtype": dtype}
    (root / "config.json").write_text(json.dumps(hf))
    gen = torch.Generator().manual_seed(seed)
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tensors = {}
    for name, shape in expected_shapes(ModelConfig.from_hf(hf)).items():
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        tensors[name] = (1.0 + 0.1 * x if "norm" in name else 0.02 * x).to(tdt).contiguous()
    save_file(tensors, str(root / "model.safetensors"))
    tok.save_pretrained(str(root))
    return root


ITERATION_OVERRIDES = ("task.name=arithmetic", "team.profile=math/duo", "team.num_agents=2", "rollout.horizon=1",
                       "algo.level=action", "ppo.epochs=1", "ppo.num_minibatches=1", "ppo.micro_batches=1",
                       "train.scoring_workers=0", "train.iterations=1", "task.train_size=64", "task.test_size=8",
                       "model.dtype=auto", "train.compilation_cache_dir=off")


def part_iteration(small: bool, budget: Budget, emit: Callable[[dict], None]) -> dict:
    import jax

    from marft_jax.config import load_config
    from marft_jax.models.known_configs import hf_config
    from marft_jax.rl.state import init_train_state
    from marft_jax.train.build import build_run

    name = "Qwen/Qwen2.5-0.5B-Instruct"
    hf = tiny_qwen2_config() if small else hf_config(name)
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    shape = ("rollout.rows=2", "rollout.max_new_tokens=8", "rollout.context_window=512") if small else (
        "rollout.rows=8", "rollout.max_new_tokens=512", "rollout.context_window=2048")
    out: dict[str, Any] = {"model": "tiny random Qwen2" if small else f"random {name} shape", "iterations": []}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model_dir = write_random_model(Path(tmp) / "model", hf, dtype)
        out["write_model_s"] = time.perf_counter() - t0
        cfg = load_config(None, list(ITERATION_OVERRIDES) + list(shape) + [
            f"model.name={model_dir}", f"train.out_dir={Path(tmp) / 'runs'}"])
        t0 = time.perf_counter()
        run = build_run(cfg)
        try:
            out["build_run_s"] = time.perf_counter() - t0
            out["attention"] = run.model.cfg.attention
            learner = run.learner
            if small:   # one prompt bucket for both agents' prompts: one sampler compile, not two
                learner.sampler.min_prompt_bucket = 128
            state = learner.place_state(init_train_state(jax.random.key(0), run.model.cfg, cfg.lora,
                                                         cfg.team.num_agents, cfg.optim))
            problems = [p for _, p in zip(range(cfg.rollout.rows), run.task.problems("train", 0))]
            first_s = None
            for it in range(1 if small else 2):     # the second: steady state, no compiles
                if it == 1 and not budget.fits(0.7 * first_s):
                    out["stopped"] = "budget: the second (steady-state) iteration not run"
                    break
                t0 = time.perf_counter()
                state, m, _ = learner.iteration(state, problems, iteration=it, env_samples=0, key=jax.random.key(it))
                secs = time.perf_counter() - t0
                first_s = first_s or secs
                out["iterations"].append({
                    "seconds": secs, "stages_s": {k.removeprefix("timing_s/"): v for k, v in m.items()
                                                  if k.startswith("timing_s/")},
                    "compiles": m.get("perf/compiles"), "mfu": m.get("perf/mfu"),
                    "hbm_bw_util": m.get("perf/hbm_bw_util"), "remat": str(learner.update_config().remat),
                    "peak_device_memory_bytes": _peak_memory()})
                emit(out)
        finally:
            run.close()
    return out


PART_FUNCTIONS = {"environment": part_environment, "attention": part_attention, "parity": part_parity,
                  "sampler": part_sampler, "update": part_update, "iteration": part_iteration}


# ---------------------------------------------------------------------------------------------
# Running the parts.


def small_compile_flags() -> None:
    """``--small``: compile without the backend's (LLVM's) optimisation passes (compiling is most
    of a run with tiny shapes). Only when ``XLA_FLAGS`` names no level, before the backend starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {SMALL_XLA_FLAG}".strip()


def run_part_here(name: str, small: bool, budget: Budget, emit: Callable[[dict], None]) -> dict:
    """Run one part in this process: ``{"ok", "result", "reason"?}`` (never raises). What the
    code it calls prints goes to stderr: stdout carries the JSON lines only."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            result = PART_FUNCTIONS[name](small, budget, emit)
        return {"ok": True, "result": result}
    except Exception as e:   # a part that cannot run here must not sink the others
        print(f"[device_check] {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return {"ok": False, "reason": f"{type(e).__name__}: {e}"[:600]}


PARTIAL, RESULT = "@@device_check partial ", "@@device_check result "


def child_main(name: str, small: bool, seconds: float | None) -> None:
    """``--part NAME``: run one part, print its progress and result lines for the parent."""
    budget = Budget(seconds)
    emit = lambda r: print(PARTIAL + json.dumps(r, default=str), flush=True)
    rec = run_part_here(name, small, budget, emit)
    rec["peak_device_memory_bytes"] = _peak_memory()
    print(RESULT + json.dumps(rec, default=str), flush=True)


def run_part_child(name: str, small: bool, budget: Budget) -> dict:
    """Run one part in a subprocess, killed when the budget runs out; its last progress line
    stands in for a result it did not finish."""
    left = budget.left()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name]
    cmd += ["--small"] if small else []
    cmd += [] if left == float("inf") else ["--budget-s", f"{max(left - 5.0, 1.0):.1f}"]
    partial, rec = None, None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=str(ROOT), env=os.environ.copy())
    deadline = None if left == float("inf") else time.monotonic() + left
    try:
        for line in _lines_until(proc, deadline):
            if line.startswith(PARTIAL):
                partial = json.loads(line[len(PARTIAL):])
            elif line.startswith(RESULT):
                rec = json.loads(line[len(RESULT):])
            else:
                print(line, end="", file=sys.stderr, flush=True)     # the part's own prints
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    if rec is not None:
        return rec
    why = "killed at the budget" if deadline is not None and time.monotonic() >= deadline else \
        f"the part's process exited with {proc.returncode}"
    out = {"ok": False, "reason": why, "peak_device_memory_bytes": None}
    if partial is not None:
        out.update(result=partial, partial=True)
    return out


def _lines_until(proc, deadline: float | None):
    """``proc``'s stdout lines until it ends or ``deadline`` passes (then it is killed)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        wait = None if deadline is None else deadline - time.monotonic()
        if wait is not None and wait <= 0:
            proc.kill()
            return
        if not sel.select(timeout=wait):
            continue
        line = proc.stdout.readline()
        if not line:
            return
        yield line


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny random models and shapes (CPU, CI: < 60 s)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for the whole check: parts that no longer fit are skipped (default: no limit)")
    p.add_argument("--skip", default="", help=f"comma-separated parts to skip: {','.join(PART_FUNCTIONS)}")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the parts in this process (default with --small) instead of one process each")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)   # a child process: one part
    args = p.parse_args(argv)
    if args.small:
        small_compile_flags()
    if args.part:
        child_main(args.part, args.small, args.budget_s)
        return {}
    in_process = args.small if args.in_process is None else args.in_process
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - set(PART_FUNCTIONS)
    if unknown:
        p.error(f"--skip: unknown part(s) {sorted(unknown)}; parts: {','.join(PART_FUNCTIONS)}")
    budget = Budget(args.budget_s)
    sink = open(args.out, "a") if args.out else None
    summary: dict[str, Any] = {"summary": True, "small": args.small, "budget_s": args.budget_s,
                               "in_process": in_process, "parts": {}, "results": {}}

    def write(obj: dict) -> None:
        line = json.dumps(obj, default=str)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()

    for name, gpu_s, small_s in PARTS:
        est = small_s if args.small else gpu_s
        t0 = time.monotonic()
        if name in skip:
            rec = {"ok": False, "skipped": True, "reason": "skipped (--skip)"}
        elif not budget.fits(est):
            rec = {"ok": False, "skipped": True,
                   "reason": f"budget: {budget.left():.0f} s left, the part is estimated at {est} s"}
        elif in_process:
            rec = run_part_here(name, args.small, budget, lambda r: None)
            rec["peak_device_memory_bytes"] = _peak_memory()
            rec["peak_device_memory_cumulative"] = True       # one process: the peak of all parts so far
        else:
            rec = run_part_child(name, args.small, budget)
        rec = {"part": name, "seconds": round(time.monotonic() - t0, 2), **rec}
        write(rec)
        summary["parts"][name] = {k: rec[k] for k in ("ok", "seconds", "reason", "skipped", "partial",
                                                      "peak_device_memory_bytes") if k in rec}
        if "result" in rec:
            summary["results"][name] = rec["result"]
    env = summary["results"].get("environment", {})
    summary.update(device_kind=env.get("device_kind"), backend=env.get("backend"),
                   wall_s=round(time.monotonic() - budget.start, 2))
    write(summary)
    if sink:
        sink.close()
    return summary


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
