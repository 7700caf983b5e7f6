"""What a run folder holds for comparisons across runs: its method, seed, held-out accuracy curve
and training reward, read from the files the trainer writes.

A run folder (``marft-jax train``'s run directory) holds ``config.yaml``, ``metrics.jsonl``,
``eval/before.json`` and ``eval/after.json`` (the untrained and trained team's held-out accuracy;
schema in :mod:`marft_jax.train.table`), ``eval/periodic/iter<N>.json`` (every
``train.eval_every`` iterations) and, once it stopped, ``summary.json``. A sweep folder holds run
folders (e.g. ``experiments/cpu_repro.py``'s ``runs/cpu_repro/<method>-s<seed>``).

:func:`read_run` returns a :class:`RunRecord`; accuracies are fractions in [0, 1] (the mean over
an evaluation's sampling seeds), iterations count training iterations (0 = before training).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np

from marft_jax.train.metric_sinks import METRICS_FILE, read_metrics
from marft_jax.train.table import (EVAL_DIR, every_agent_answers, headline_seeds, read_result, run_config,
                                   run_is_independent)

PERIODIC = re.compile(r"iter(\d+)\.json$")
_MARKERS = ("summary.json", "config.yaml", METRICS_FILE, EVAL_DIR)


class Arm(NamedTuple):
    """How runs are grouped across seeds: the eval files' method, agents and roles."""
    method: str
    agents: int
    roles: str


@dataclass
class RunRecord:
    """One run folder.

    Attributes:
      run_dir: the folder.
      arm: its method/agents/roles from the trained team's evaluation (None before the first one).
      benchmark: the evaluated task (None before the first trained evaluation).
      seed: ``train.seed`` from ``config.yaml`` (None if absent).
      before, after: held-out accuracy of the untrained / trained team (``eval/before.json`` and
        ``eval/after.json``, else ``summary.json``; None when not measured yet): for independent
        agents the mean of the per-agent accuracies (``table.headline_seeds``). A run that shares
        another run's untrained evaluation names it in ``summary.json``'s
        ``accuracy_before_from``: that run's ``eval/before.json`` is read.
      all_correct_before, all_correct_after: independent agents only: the fraction of episodes
        whose every agent is correct (the team verdict); None otherwise.
      iterations: training iterations done (``summary.json``; None while running).
      curve: iteration -> held-out accuracy (0 = before, periodic evaluations, the last
        iteration = after).
      train_reward: iteration -> mean training reward (``episode/score_mean`` in metrics.jsonl).
      wall_s: the run's wall time in seconds when the sweep recorded it (``summary.json``).
    """
    run_dir: Path
    arm: Arm | None = None
    benchmark: str | None = None
    seed: int | None = None
    before: float | None = None
    after: float | None = None
    all_correct_before: float | None = None
    all_correct_after: float | None = None
    iterations: int | None = None
    curve: dict[int, float] = field(default_factory=dict)
    train_reward: dict[int, float] = field(default_factory=dict)
    wall_s: float | None = None

    @property
    def finished(self) -> bool:
        """Both held-out accuracies exist (what ``experiments/cpu_repro.py`` reuses)."""
        return self.before is not None and self.after is not None


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / m).exists() for m in _MARKERS)


def expand_run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """Run folders from paths that are run folders or sweep folders (folders of run folders, taken
    in name order). Raises FileNotFoundError naming a path that is missing or holds no run."""
    out: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise FileNotFoundError(f"{str(p)!r} does not exist or is not a directory")
        if is_run_dir(p):
            out.append(p)
            continue
        runs = sorted(c for c in p.iterdir() if is_run_dir(c))
        if not runs:
            raise FileNotFoundError(f"{str(p)!r} is neither a run folder nor a folder of run folders "
                                    f"(none of {list(_MARKERS)} found)")
        out += runs
    return out


def _accuracy(rec: dict, independent: bool | None) -> float:
    return float(np.mean(headline_seeds(rec, run_independent=independent)))


def _all_correct(rec: dict, independent: bool | None) -> float | None:
    return float(np.mean(rec["seeds"])) if every_agent_answers(rec, independent) else None


def train_reward(run_dir: str | Path) -> dict[int, float]:
    """Iteration -> ``episode/score_mean`` from the run's metrics.jsonl (empty if none)."""
    return {int(r["step"]): float(r["episode/score_mean"]) for r in read_metrics(run_dir)
            if "episode/score_mean" in r}


def read_run(run_dir: str | Path) -> RunRecord:
    """Read one run folder (see the module docstring); schema errors of eval files name the file."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    train_cfg = cfg.get("train") or {}
    rec = RunRecord(run_dir, seed=train_cfg.get("seed"), train_reward=train_reward(run_dir))
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    rec.iterations, rec.wall_s = summary.get("iterations"), summary.get("wall_s")
    rec.before, rec.after = summary.get("accuracy_before"), summary.get("accuracy_after")

    independent = run_is_independent(cfg)
    eval_dir = run_dir / EVAL_DIR
    before_path = eval_dir / "before.json"
    shared = summary.get("accuracy_before_from")
    if not before_path.is_file() and isinstance(shared, str) and shared:
        before_path = run_dir.parent / shared / EVAL_DIR / "before.json"
    if before_path.is_file():
        res = read_result(before_path)
        rec.before, rec.all_correct_before = _accuracy(res, independent), _all_correct(res, independent)
    if rec.before is not None:
        rec.curve[0] = float(rec.before)
    trained = []                       # (iteration, result) of the trained team, oldest first
    for path in sorted((eval_dir / "periodic").glob("iter*.json")):
        m = PERIODIC.search(path.name)
        if m:
            trained.append((int(m.group(1)), read_result(path)))
    latest = trained[-1][1] if trained else None
    after_path = eval_dir / "after.json"
    if after_path.is_file():
        latest = read_result(after_path)
        rec.after, rec.all_correct_after = _accuracy(latest, independent), _all_correct(latest, independent)
        last = rec.iterations if rec.iterations is not None else train_cfg.get("iterations")
        if last is not None:
            trained.append((int(last), latest))
    for it, res in trained:
        rec.curve[it] = _accuracy(res, independent)
    if latest is not None:
        rec.arm = Arm(latest["method"], latest["agents"], latest["roles"])
        rec.benchmark = latest["benchmark"]
    return rec


def read_runs(paths: Iterable[str | Path]) -> list[RunRecord]:
    """:func:`read_run` of every run folder under ``paths`` (:func:`expand_run_dirs`)."""
    return [read_run(d) for d in expand_run_dirs(paths)]
