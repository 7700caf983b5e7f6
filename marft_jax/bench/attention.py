"""Whole-row causal attention on the CPU: ``model.causal_attention`` native vs XLA's blocked path.

One decoder layer's attention at a model's head shape over ``B`` rows of ``T`` tokens (one
segment a row, the causal mask): the forward, and forward + backward (the gradient of a
weighted sum of the output with respect to q, k and v), each timed as its own jitted program
(best of ``--repeats``). FLOPs count the exact causal triangle: the forward's two matmuls (Q Kᵀ,
P V) are ``4 · heads · D`` per (query, visible key) pair; the backward adds five (the scores
recomputed, dP, dQ, dK, dV), so forward + backward is ``14 · heads · D`` per pair. The floor is
those FLOPs at the float32 matmul roofline measured in the same run (``jnp`` matmul of
``--roofline-n``); exponentials and masking are not counted.

Last stdout line: one JSON object (``ours`` = native, ``baseline`` = xla, ``ratio`` =
baseline / ours seconds, ``floor_s``, ``ours_over_floor``), per program.
"""

from __future__ import annotations

import argparse
import json
import platform
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax.bench.machine import cpu_model
from marft_jax.bench.sampler import matmul_roofline_flops
from marft_jax.models import attention as attention_lib
from marft_jax.models import causal_attention
from marft_jax.train.peaks import best_time


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4, help="rows B")
    p.add_argument("--tokens", type=int, default=1504, help="tokens per row T (the reference workload's packed rows)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--roofline-n", type=int, default=3072)
    args = p.parse_args(argv)
    st = causal_attention.status()
    if not st.available:
        raise SystemExit(f"bench attention: the native kernel is unavailable: {st.reason}")
    b, t, nh, nkv, d = args.rows, args.tokens, args.heads, args.kv_heads, args.head_dim
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(b, t, nh, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, nkv, t, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, nkv, t, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(b, t, nh, d)), jnp.float32)
    mask = attention_lib.segment_mask(jnp.ones((b, t), jnp.int32))
    sides = {"xla": lambda q, k, v: attention_lib.xla_attention(q, k, v, mask, causal=True),
             "native": lambda q, k, v: causal_attention.attend(q, k, v, mask)}
    pairs = b * nh * t * (t + 1) // 2
    flops = {"forward": 4.0 * pairs * d, "forward_backward": 14.0 * pairs * d}
    roofs = [matmul_roofline_flops(args.roofline_n)]
    seconds: dict[str, dict[str, float]] = {}
    for name, fn in sides.items():
        grad = jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2))
        seconds[name] = {"forward": best_time(jax.jit(fn), q, k, v, repeats=args.repeats),
                         "forward_backward": best_time(jax.jit(grad), q, k, v, repeats=args.repeats)}
    roofs.append(matmul_roofline_flops(args.roofline_n))
    roof = max(roofs)
    programs: dict[str, Any] = {}
    for prog, f in flops.items():
        ours, base = seconds["native"][prog], seconds["xla"][prog]
        programs[prog] = {"ours_s": ours, "baseline_s": base, "ratio": base / ours, "flops": f,
                          "floor_s": f / roof, "ours_over_floor": ours * roof / f,
                          "baseline_over_floor": base * roof / f,
                          "ours_flops_per_s": f / ours, "baseline_flops_per_s": f / base}
    report = {"bench": "attention", "shape": {"rows": b, "tokens": t, "heads": nh, "kv_heads": nkv, "head_dim": d},
              "ours": "model.causal_attention=native", "baseline": "model.causal_attention=xla (blocked causal)",
              "programs": programs, "matmul_roofline_flops_per_s": roof, "roofline_samples": roofs,
              "cpu": cpu_model(), "machine": platform.machine(), "threads_note": "XLA's intra-op threads",
              "jax_version": jax.__version__, "kernel_library": st.library}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
