"""The critic-free ``group`` estimator against ``gae``: seconds per training iteration, one run.

Both sides are the ``demo`` preset (``--preset``) built by ``build_run``, each from a fresh
state of the same seed, and play as many episodes per iteration (``rollout.rows``): ``gae``
plays ``rows`` problems once, ``group`` plays ``rows / group_size`` problems ``group_size``
times each (``ProblemStream.take``). After ``--warmup`` iterations each (which compile), the
sides alternate iteration by iteration (so a change of the machine's load hits both), each on
its own stream of problems and its own sampling keys. Reported per side: the median of
``timing_s/step`` and of each stage (``rollout``, ``values_logprobs_backup``: the feature
pass, values and backups, ``update``), the prepare pass's computed tokens, and the generated
tokens (both sides sample their own responses, so the rollout's work differs a little).

Prints ONE JSON object (the last stdout line): ``ours`` (group), ``baseline`` (gae), ``ratio``
= baseline median step / ours (> 1: group is faster) and ``ratio_without_rollout`` (the
stages the estimator changes). No physical floor is counted here: both sides run the same
kernels; the floor of an iteration is :mod:`marft_jax.bench.iteration`'s.

Usage::

    marft-jax bench estimators                      # demo preset, 2 warm-up + 6 measured each
    marft-jax bench estimators --iterations 3 --warmup 1 rollout.rows=4   # overrides after the flags
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Sequence

import numpy as np

STAGES = ("step", "rollout", "values_logprobs_backup", "update")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="marft-jax bench estimators", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="demo")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--group-scale", default="std", choices=("std", "none"))
    p.add_argument("--warmup", type=int, default=2, help="iterations per side before measuring (compiles)")
    p.add_argument("--iterations", type=int, default=6, help="measured iterations per side")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*", help="config overrides for both sides (key=value)")
    return p


class _Side:
    """One estimator's run: its learner, state, problem stream and per-iteration metrics."""

    def __init__(self, name: str, cfg):
        from marft_jax.train.build import build_run, fresh_state
        from marft_jax.train.trainer import ProblemStream

        self.name, self.cfg = name, cfg
        self.run = build_run(cfg)
        self.learner = self.run.learner
        self.state = self.learner.place_state(fresh_state(cfg, self.run.model.cfg))
        self.stream = ProblemStream(self.run.task, cfg.train.seed)
        self.env_samples = 0
        self.metrics: list[dict] = []

    def step(self, it: int) -> dict:
        import jax

        problems = self.stream.take(self.cfg.rollout.rows, self.cfg.rollout.group_size)
        key = jax.random.fold_in(jax.random.key(self.cfg.train.seed), it)
        self.state, m, _ = self.learner.iteration(self.state, problems, iteration=it,
                                                  env_samples=self.env_samples, key=key)
        self.env_samples = m["env_samples"]
        return m

    def report(self) -> dict:
        med = lambda k: float(np.median([m[k] for m in self.metrics]))
        out = {f"{s}_s": med(f"timing_s/{s}") for s in STAGES}
        out["without_rollout_s"] = float(np.median([m["timing_s/step"] - m["timing_s/rollout"] for m in self.metrics]))
        out["prepare_computed_tokens"] = med("perf/tokens/prepare/computed")
        out["update_computed_tokens"] = med("perf/tokens/update/computed")
        out["generated_tokens_per_s"] = med("perf/rollout_tokens_per_s")
        out["compiles_measured"] = int(sum(m.get("perf/compiles", 0) for m in self.metrics))
        out["accuracy_mean"] = float(np.mean([m["episode/accuracy"] for m in self.metrics]))
        out["critic"] = self.state.critic is not None
        return out

    def close(self) -> None:
        self.run.close()


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__), check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.warmup < 1 or args.iterations < 1:
        raise SystemExit("--warmup and --iterations must be >= 1 (the measured iterations must not compile)")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from marft_jax.config import load_config
    from marft_jax.train.build import check_names

    common = [f"train.seed={args.seed}", *args.overrides]
    group = ["algo.advantage=group", f"rollout.group_size={args.group_size}", f"algo.group_scale={args.group_scale}"]
    cfgs = {"gae": check_names(load_config(args.preset, common + ["algo.advantage=gae", "rollout.group_size=1"])),
            "group": check_names(load_config(args.preset, common + group))}
    t0 = time.perf_counter()
    sides = {name: _Side(name, cfg) for name, cfg in cfgs.items()}
    try:
        for it in range(args.warmup):
            for side in sides.values():
                side.step(it)
        for it in range(args.warmup, args.warmup + args.iterations):
            for side in sides.values():
                side.metrics.append(side.step(it))
        ours, base = sides["group"].report(), sides["gae"].report()
    finally:
        for side in sides.values():
            side.close()
    res = {
        "benchmark": "estimators", "preset": args.preset, "overrides": common, "group": group,
        "rows": cfgs["gae"].rollout.rows, "warmup": args.warmup, "iterations": args.iterations,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},
        "commit": _commit(), "wall_s": time.perf_counter() - t0,
        "ours": ours, "baseline": base,
        "ratio": base["step_s"] / max(ours["step_s"], 1e-9),
        "ratio_without_rollout": base["without_rollout_s"] / max(ours["without_rollout_s"], 1e-9),
        "floor": None,
    }
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
