"""Token-level backup throughput: jitted MARFT-T GAE vs two Python-loop baselines, same inputs,
same run: the NumPy transcription of the reference recurrence (``marft_jax.bench.reference_backups``,
the test oracle) and the reference implementation's own buffer loop re-expressed
(``marft_jax.bench.g1_token_gae``: threads x steps x agents x tokens on float32 buffers).

    python -m marft_jax.bench.backups [--rows 32 --agents 4 --tokens 512 --steps 2]

Prints one JSON object: our seconds per call after compile (median and best), the jit compile
time separately, decision points per second, both baselines' figures, the speedups, the max abs
differences between the results, shapes, JAX backend/devices and CPU info. ``impl`` defaults to
``auto`` (the fused native kernel on a single-device CPU when it builds, else ``blocked``);
``native_kernel`` reports the kernel's build (the C++ compile on a cache miss, timed apart from
the jit compile) and ``--all-impls`` adds a row per other implementation (``blocked``, the
XLA-only figure, included). The G1 loop cannot take empty responses (it crashes on them), so
with ``--lengths random`` it is skipped.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax.bench import g1_token_gae
from marft_jax.bench.machine import cpu_info
from marft_jax.bench import reference_backups as backups_reference
from marft_jax.rl import backups, layout, native, rewards


IMPL_ROWS = ("native", "blocked", "scan", "associative")   # --all-impls, besides ours


def make_inputs(steps: int, rows: int, agents: int, tokens: int, lengths: str, seed: int):
    """Whole-episode rows in the canonical layout (NumPy): half terminal, half truncated."""
    rng = np.random.default_rng(seed)
    if lengths == "full":
        lens = np.full((steps, rows, agents), tokens)
    else:  # "random": uniform in [0, tokens], empty responses included
        lens = rng.integers(0, tokens + 1, size=(steps, rows, agents))
    act_mask = np.arange(tokens) < lens[..., None]
    step_mask = np.ones((steps, rows), bool)
    terminal = np.zeros((steps, rows), bool)
    truncated = np.zeros((steps, rows), bool)
    terminal[-1, ::2] = True
    truncated[-1, 1::2] = True
    dp = np.asarray(layout.token_decision_mask(act_mask, step_mask))
    score = rng.random(rows).astype(np.float32)
    reward = np.asarray(rewards.place_reward(jnp.asarray(score), jnp.asarray(dp), jnp.asarray(step_mask)))
    value = rng.normal(size=(steps, rows, agents, tokens)).astype(np.float32)
    v_boot = rng.normal(size=rows).astype(np.float32)
    return reward, value, dp, step_mask, terminal, truncated, v_boot


def _time_calls(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t0)
    return out


def bench_ours(args_np, impl: str, gamma: float, lam: float, repeats: int) -> tuple[dict, np.ndarray]:
    fn = jax.jit(functools.partial(backups.token_level_gae, gamma=gamma, lam=lam, impl=impl))
    args = [jax.device_put(a) for a in args_np]
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    result = jax.block_until_ready(compiled(*args))
    times = _time_calls(lambda: compiled(*args), repeats)
    return ({"impl": backups.resolve_impl(impl), "compile_s": compile_s,
             "s_per_call": statistics.median(times), "s_per_call_best": min(times),
             "repeats": repeats}, np.asarray(result.advantages))


def native_kernel_report() -> dict:
    """Builds (or loads from the cache) the native kernel; its figures, compile apart."""
    st = native.status()
    return {"available": st.available, "reason": st.reason or None, "library": st.library,
            "compiled_now": st.compiled, "compile_s": st.compile_s, "build_and_load_s": st.load_s}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--lengths", choices=["full", "random"], default="full",
                   help="full: every response uses the whole budget; random: uniform in [0, tokens]")
    p.add_argument("--impl", default="auto", choices=list(backups.IMPLS))
    p.add_argument("--all-impls", action="store_true", help="also time every other impl")
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--baseline-repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    cpu = cpu_info()
    args_np = make_inputs(a.steps, a.rows, a.agents, a.tokens, a.lengths, a.seed)
    points = int(args_np[2].sum())

    kernel = native_kernel_report() if jax.default_backend() == "cpu" else None
    ours, adv = bench_ours(args_np, a.impl, a.gamma, a.lam, a.repeats)
    others = {}
    if a.all_impls:
        for impl in IMPL_ROWS:
            if impl == ours["impl"]:
                continue
            if impl == "native" and not (kernel and kernel["available"]):
                others[impl] = {"skipped": kernel["reason"] if kernel else "not a CPU backend"}
                continue
            others[impl] = bench_ours(args_np, impl, a.gamma, a.lam, a.repeats)[0]

    base_times, base_adv = [], None
    for _ in range(a.baseline_repeats):
        t0 = time.perf_counter()
        base_adv, _ = backups_reference.token_level_gae_reference(*args_np, gamma=a.gamma, lam=a.lam)
        base_times.append(time.perf_counter() - t0)
    base = {"name": "NumPy/Python loop transcription of the reference "
                    "(marft_jax.bench.reference_backups.token_level_gae_reference)",
            "s_per_call": statistics.median(base_times), "s_per_call_best": min(base_times),
            "repeats": a.baseline_repeats}
    g1 = None
    try:
        g1_buffers = [g1_token_gae.g1_buffers(*args_np) for _ in range(a.baseline_repeats)]
    except ValueError as e:
        g1 = {"skipped": str(e)}
    if g1 is None:
        g1_times = []
        for buf in g1_buffers:                       # fresh buffers per call, filled untimed
            t0 = time.perf_counter()
            g1_token_gae.g1_token_gae(buf, a.gamma, a.lam)
            g1_times.append(time.perf_counter() - t0)
        g1_adv = g1_token_gae.advantages_canonical(g1_buffers[-1])
        g1 = {"name": "the reference's buffer loop (marft_jax.bench.g1_token_gae.g1_token_gae)",
              "s_per_call": statistics.median(g1_times), "s_per_call_best": min(g1_times),
              "repeats": a.baseline_repeats,
              "max_abs_diff_vs_ours": float(np.max(np.abs(adv - g1_adv)))}
    for d in (ours, base, *others.values(), g1):
        if "s_per_call" in d:
            d["decision_points_per_s"] = points / d["s_per_call"]
    for d in others.values():
        if "s_per_call" in d:
            d["speedup"] = base["s_per_call"] / d["s_per_call"]
            d["speedup_best"] = base["s_per_call_best"] / d["s_per_call_best"]

    report = {
        "bench": "token_level_backup",
        "shape": {"steps": a.steps, "rows": a.rows, "agents": a.agents, "tokens": a.tokens,
                  "layout": "[step, batch, agent, token]"},
        "lengths": a.lengths,
        "decision_points": points,
        "gamma": a.gamma, "lam": a.lam,
        "ours": ours,
        "native_kernel": kernel,
        "baseline": base,
        "speedup": base["s_per_call"] / ours["s_per_call"],
        "speedup_best": base["s_per_call_best"] / ours["s_per_call_best"],
        "max_abs_diff_vs_baseline": float(np.max(np.abs(adv - base_adv))),
        "baseline_g1_loop": g1,
        "speedup_vs_g1_loop": g1["s_per_call"] / ours["s_per_call"] if "s_per_call" in g1 else None,
        "jax": {"version": jax.__version__, "backend": jax.default_backend(),
                "devices": [str(d) for d in jax.devices()]},
        "cpu": cpu,
        "python": sys.version.split()[0],
    }
    if others:
        report["other_impls"] = others
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
