"""CPU reproduction of the paper's comparison on the generated arithmetic task: MARFT-A, MARFT-T,
independent PPO and a single agent (Duo), MARFT-A and independent PPO (Trio), and MARFT-A with
anonymous roles, several seeds each, one run after another in this process.

    python experiments/cpu_repro.py                       # 7 methods x seeds 0-4, ~5 hours on 2 cores
    python experiments/cpu_repro.py --seeds 0 --methods marft_a single train.iterations=4

Each run uses the preset ``experiments/configs/cpu_repro/<method>.yaml`` (the same budgets for
all: 30 iterations x 8 episodes; they differ only in the method keys) plus the overrides given
here. Runs go to
``<runs-dir>/<method>-s<seed>``; a finished run (its ``summary.json`` has an after-training
accuracy) is reused, so an interrupted sweep continues where it stopped. JAX's persistent
compilation cache is shared by the runs, so only the first run of each shape pays the compile.
The untrained team is the base model whatever the seed (LoRA B starts at zero) and greedy
evaluation is deterministic, so runs whose untrained evaluation would be identical share the
first one (``train.eval_before=false`` for the others; ``accuracy_before_from`` in their
summary names the run that measured it): MARFT-A and MARFT-T share one, each method's later
seeds reuse their first seed's.

Writes to ``--out`` (small files, meant to be committed): ``results.md`` (the command, commit,
machine, date and wall time; the table in the paper's layout; each method's accuracy before and
after and its change, mean ± standard error over seeds, with a 95 % bootstrap interval of the
change against independent PPO of the same team size and a verdict; stability; the Duo -> Trio
margin, named vs anonymous; per-seed rows; a ``## Reading`` section left for a hand-written
reading, kept when the file is rewritten), ``results.csv`` (per seed), ``results.json`` (every
number, held-out curves, training rewards), ``table.tex``, ``heldout_accuracy.png`` and
``training_reward.png`` (mean ± 1 standard error over seeds per method).

    python experiments/cpu_repro.py --aggregate-only      # no training: results of the finished runs

``--aggregate-only`` reads the finished runs in ``--runs-dir`` (of a running, stopped or
finished sweep) and writes the results.

Run folders are not committed (checkpoints), so a sweep spread over machines carries its finished
runs in the committed ``results.json``: ``--prior-results`` adds that file's runs to those of
``--runs-dir`` (a run in both: the run folder's), so seeds trained elsewhere and seeds trained here
pool into one table. Each row says where it came from (``source``)::

    python experiments/cpu_repro.py --seeds 2 3 4 --prior-results experiments/results/cpu_repro/results.json
    python experiments/cpu_repro.py --aggregate-only --prior-results experiments/results/cpu_repro/results.json
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
METHODS = {
    "marft_a": "MARFT-A (Duo, chained, action level)",
    "marft_t": "MARFT-T (Duo, chained, token level)",
    "ippo": "independent PPO (Duo, parallel)",
    "single": "single agent (PPO-A)",
    "marft_a_anonymous": "MARFT-A (Duo, anonymous roles)",
    "trio_marft_a": "MARFT-A (Trio, chained, action level)",
    "trio_ippo": "independent PPO (Trio, parallel)",
}
# How the trainer's eval files name each method's runs (method, agents, roles; the table's rows).
METHOD_ARMS = {
    "marft_a": ("MARFT-A", 2, "named"),
    "marft_t": ("MARFT-T", 2, "named"),
    "ippo": ("independent PPO", 2, "named"),
    "single": ("single agent (PPO-A)", 1, "named"),
    "marft_a_anonymous": ("MARFT-A", 2, "anonymous"),
    "trio_marft_a": ("MARFT-A", 3, "named"),
    "trio_ippo": ("independent PPO", 3, "named"),
}
# The comparisons the results report (marft_jax.train.repro_stats.sweep_report):
BASELINES = {"marft_a": "ippo", "marft_t": "ippo", "single": "ippo", "marft_a_anonymous": "ippo",
             "trio_marft_a": "trio_ippo"}                        # change against IPPO of the same size
SPREAD_PAIRS = [("marft_a", "marft_t")]                          # stability: action vs token level
MARGIN_PAIRS = [(("marft_a", "ippo"), ("trio_marft_a", "trio_ippo"))]   # Duo -> Trio margin
DIFFERENCES = [("marft_a", "single"), ("marft_a", "marft_a_anonymous")]  # vs a single agent; named vs anonymous
BENCHMARK = "arithmetic-l1"        # the eval files' name of the task (a row without one gets it)
READING_PLACEHOLDER = "(written by hand after the sweep: say only what the intervals support)"


def _machine() -> str:
    from marft_jax.bench.machine import cpu_model

    return f"{cpu_model()}, {os.cpu_count()} logical cores, {platform.system()} (CPU only)"


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return out + ("+local changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def untrained_key(cfg) -> str:
    """What the untrained team's greedy evaluation depends on. LoRA B starts at zero, so the
    untrained team is the base model whatever the seed: runs with equal keys (MARFT-A and
    MARFT-T share the chained Duo prompts) share one evaluation."""
    parts = {"model": cfg.model.name, "task": [cfg.task.name, cfg.task.level], "team": cfg.team.profile,
             "agents": cfg.team.num_agents, "mode": cfg.rollout.mode,
             "rollout": [cfg.rollout.max_new_tokens, cfg.rollout.context_window, cfg.rollout.horizon,
                         cfg.rollout.prompt_format],
             "eval": [cfg.train.eval_problems, cfg.train.eval_temperature]}
    return json.dumps(parts, sort_keys=True)


def known_untrained(runs_dir: Path, overrides: list[str]) -> dict:
    """:func:`untrained_key` -> ``(accuracy, run name)`` of the untrained evaluations that the
    finished runs in ``runs_dir`` made, whatever their seeds: a sweep over other seeds (or
    methods) shares them instead of evaluating again."""
    from marft_jax.config import load_config

    found = {}
    for method in METHODS:
        summaries = sorted(runs_dir.glob(f"{method}-s*/summary.json"))
        if not summaries:
            continue
        key = untrained_key(load_config(f"cpu_repro/{method}", list(overrides)))
        for path in summaries:
            done = json.loads(path.read_text())
            if done.get("accuracy_after") is not None and done.get("accuracy_before") is not None:
                found.setdefault(key, (done["accuracy_before"], done.get("accuracy_before_from", path.parent.name)))
    return found


def run_one(method: str, seed: int, overrides: list[str], runs_dir: Path, untrained: dict) -> dict:
    """Train one method/seed (or reuse a finished run). ``untrained`` maps :func:`untrained_key`
    to ``(accuracy, run name)`` of an evaluation already made; it is filled in here."""
    from marft_jax.config import load_config
    from marft_jax.train.trainer import train

    run_dir = runs_dir / f"{method}-s{seed}"
    summary_path = run_dir / "summary.json"
    over = overrides + [f"train.seed={seed}", f"train.out_dir={runs_dir}", f"train.run_name={method}-s{seed}"]
    cfg = load_config(f"cpu_repro/{method}", over)
    key = untrained_key(cfg)
    earlier_wall_s = 0.0
    if summary_path.exists():
        done = json.loads(summary_path.read_text())
        if done.get("accuracy_after") is not None and done.get("accuracy_before") is not None:
            untrained.setdefault(key, (done["accuracy_before"], run_dir.name))
            if done["iterations"] >= cfg.train.iterations:
                print(f"[cpu_repro] {method} seed {seed}: reusing {run_dir}", flush=True)
                return done
            earlier_wall_s = extend_run(run_dir, done)
            print(f"[cpu_repro] {method} seed {seed}: extending {run_dir} from {done['iterations']} to "
                  f"{cfg.train.iterations} iterations", flush=True)
        else:
            earlier_wall_s = float(done.get("earlier_wall_s") or 0.0)
    shared = untrained.get(key)
    if shared is not None:
        cfg.train.eval_before = False
    t0 = time.perf_counter()
    summary = train(cfg)
    if summary.get("accuracy_after") is None:      # stopped by a signal: its checkpoint resumes it
        if earlier_wall_s:
            summary_path.write_text(json.dumps({**summary, "earlier_wall_s": earlier_wall_s}, indent=2))
        raise SystemExit(f"[cpu_repro] {method} seed {seed} stopped at iteration {summary['iterations']} "
                         f"({run_dir}); run the same command again to resume")
    summary["wall_s"] = round(earlier_wall_s + time.perf_counter() - t0, 1)
    if shared is not None:
        summary["accuracy_before"], summary["accuracy_before_from"] = shared
    else:
        untrained[key] = (summary["accuracy_before"], run_dir.name)
    summary_path.write_text(json.dumps(summary, indent=2))
    print(f"[cpu_repro] {method} seed {seed}: {summary['accuracy_before']:.3f} -> "
          f"{summary.get('accuracy_after', float('nan')):.3f} in {summary['wall_s']:.0f}s "
          f"({summary['iterations']} iterations)", flush=True)
    return summary


def extend_run(run_dir: Path, done: dict) -> float:
    """Prepare a finished run for more iterations (a longer ``train.iterations``; the trainer
    resumes from its last checkpoint): its trained evaluation becomes a point of the held-out
    curve (``eval/after.json`` -> ``eval/periodic/iter<N>.json``) and its summary says it is
    not finished. Returns the wall time the run has taken so far (seconds; 0 if unknown)."""
    from marft_jax.train.table import EVAL_DIR

    after = run_dir / EVAL_DIR / "after.json"
    point = run_dir / EVAL_DIR / "periodic" / f"iter{done['iterations']:06d}.json"
    if after.is_file():
        point.parent.mkdir(parents=True, exist_ok=True)
        doc = json.loads(after.read_text())
        point.write_text(json.dumps({**doc, "tag": point.stem}, indent=2))
        after.unlink()
    earlier = float(done.get("wall_s") or 0.0)
    summary = {k: v for k, v in done.items() if k not in ("accuracy_after", "wall_s")}
    (run_dir / "summary.json").write_text(json.dumps({**summary, "earlier_wall_s": earlier}, indent=2))
    return earlier


def _pm(mean: float, se: float, signed: bool = False) -> str:
    """``12.3 ± 1.2`` (points); just the mean where the SE is undefined (one seed)."""
    text = f"{mean:+.1f}" if signed else f"{mean:.1f}"
    return text + (f" ± {se:.1f}" if math.isfinite(se) else "")


def _num(x: float, spec: str = ".1f") -> str:
    """``x`` formatted, ``–`` where undefined (a spread of one seed)."""
    return format(x, spec) if x is not None and math.isfinite(x) else "–"


def _interval(c: dict) -> str:
    if c["low_pp"] is None:
        return "–"
    return f"[{c['low_pp']:+.1f}, {c['high_pp']:+.1f}]"


def _label(m: str) -> str:
    return METHODS.get(m, m)


def _short(m: str) -> str:
    """``MARFT-A · Duo``, ``MARFT-A · Duo · anonymous``: the name comparisons use."""
    from marft_jax.train.run_records import Arm
    from marft_jax.train.sweep_plot import arm_label

    return arm_label(Arm(*METHOD_ARMS[m]))


def collect_rows(runs_dir: Path, methods=None, seeds=None) -> list[dict]:
    """The finished runs of a sweep folder (``<method>-s<seed>`` whose ``summary.json`` has both
    accuracies), as the rows :func:`main` builds, seed-major like the sweep's plan. ``methods``,
    ``seeds``: keep only these (None: all of :data:`METHODS`, every seed)."""
    from marft_jax.train.run_records import read_run

    if not runs_dir.is_dir():
        raise FileNotFoundError(f"--runs-dir {str(runs_dir)!r} does not exist")
    found = []
    for d in runs_dir.iterdir():
        m, sep, seed = d.name.rpartition("-s")
        if not (sep and seed.isdigit() and m in METHODS and d.is_dir()):
            continue
        if (methods is not None and m not in methods) or (seeds is not None and int(seed) not in seeds):
            continue
        rec = read_run(d)
        if rec.finished:
            found.append((int(seed), list(METHODS).index(m), m, rec))
    return [run_row(m, seed, rec) for seed, _, m, rec in sorted(found, key=lambda t: t[:2])]


def _plan_order(row: dict) -> tuple[int, int]:
    """The sweep's order of a row: seed-major, then :data:`METHODS`' order."""
    return row["seed"], list(METHODS).index(row["method"])


def run_row(method: str, seed: int, rec) -> dict:
    """One finished run (a ``run_records.RunRecord``) as a row of the results. Accuracies are
    what the run reports (independent PPO: the mean over agents); ``all_correct_*``: the
    fraction of episodes whose every agent is correct (independent PPO only, else None);
    ``source``: "run folder" (:func:`prior_rows` names an earlier results.json instead)."""
    return {"method": method, "seed": seed, "accuracy_before": rec.before, "accuracy_after": rec.after,
            "delta": rec.after - rec.before, "all_correct_before": rec.all_correct_before,
            "all_correct_after": rec.all_correct_after, "iterations": rec.iterations, "wall_s": rec.wall_s,
            "train_reward": [v for _, v in sorted(rec.train_reward.items())],
            "heldout": rec.curve, "benchmark": rec.benchmark, "source": "run folder"}


# The fields a row of an earlier results.json must have (the rest default to None/empty).
PRIOR_FIELDS = ("method", "seed", "accuracy_before", "accuracy_after", "iterations", "train_reward")


def prior_rows(path: Path, methods=None, seeds=None) -> list[dict]:
    """The runs of an earlier ``results.json`` (``--prior-results``) as rows, ``methods`` x
    ``seeds`` only (None: all). A row carried over before keeps its ``source``; one that the
    aggregation that wrote the file read from a run folder gets ``results.json of <commit> (<date>)``. Raises ValueError
    naming the file, the run and the field where the file is not a results.json of this script."""
    flag = f"--prior-results {str(path)!r}"
    if not path.is_file():
        raise FileNotFoundError(f"{flag} does not exist")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}: not JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
        raise ValueError(f"{flag}: no 'runs' list (is it the results.json that cpu_repro.py writes?)")
    origin = f"results.json of {doc.get('commit', 'unknown commit')} ({doc.get('date', 'undated')})"
    rows = []
    for i, run in enumerate(doc["runs"]):
        where = f"{flag}, runs[{i}]"
        missing = [k for k in PRIOR_FIELDS if not isinstance(run, dict) or run.get(k) is None]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}")
        if run["method"] not in METHODS:
            raise ValueError(f"{where}: field 'method' is {run['method']!r}, not one of {list(METHODS)}")
        try:
            heldout = {int(k): float(v) for k, v in (run.get("heldout") or {}).items()}
            row = {**run, "seed": int(run["seed"]), "accuracy_before": float(run["accuracy_before"]),
                   "accuracy_after": float(run["accuracy_after"]), "iterations": int(run["iterations"]),
                   "train_reward": [float(v) for v in run["train_reward"]], "heldout": heldout}
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: a field is not a number ({e})") from None
        row["delta"] = row["accuracy_after"] - row["accuracy_before"]
        if row.get("source") in (None, "run folder"):      # read from a folder by the aggregation that wrote it
            row["source"] = origin
        for k in ("all_correct_before", "all_correct_after", "wall_s", "benchmark"):
            row.setdefault(k, None)
        if (methods is None or row["method"] in methods) and (seeds is None or row["seed"] in seeds):
            rows.append(row)
    return rows


def merge_rows(fresh: list[dict], prior: list[dict]) -> list[dict]:
    """``fresh`` rows (run folders) and the ``prior`` rows of runs not among them, seed-major in
    the sweep's order (a method/seed in both: the fresh row)."""
    have = {(r["method"], r["seed"]) for r in fresh}
    rows = fresh + [r for r in prior if (r["method"], r["seed"]) not in have]
    return sorted(rows, key=_plan_order)


def _by_method(rows: list[dict]) -> dict[str, list[dict]]:
    return {m: [r for r in rows if r["method"] == m] for m in METHODS if any(r["method"] == m for r in rows)}


def statistics(rows: list[dict], **boot) -> dict:
    """Per method (``repro_stats.seed_summary``) and the comparisons of the issue
    (``repro_stats.sweep_report``), in percentage points. ``boot``: bootstrap options."""
    from marft_jax.train.repro_stats import seed_summary, sweep_report

    by = _by_method(rows)
    methods = {m: seed_summary([r["accuracy_before"] for r in rs], [r["accuracy_after"] for r in rs])
               for m, rs in by.items()}
    changes = {m: [r["accuracy_after"] - r["accuracy_before"] for r in rs] for m, rs in by.items()}
    report = sweep_report(changes, baselines=BASELINES, spread_pairs=SPREAD_PAIRS, margin_pairs=MARGIN_PAIRS,
                          differences=DIFFERENCES, names={m: _short(m) for m in METHODS}, **boot)
    return {"methods": methods, **report}


def paper_rows(rows: list[dict]) -> list[dict]:
    """Rows of ``marft_jax.train.table`` (its layout writers): each method's held-out accuracy
    after training, its seeds pooled per benchmark (the runs' task; :data:`BENCHMARK` where a
    row does not say); independent PPO also as a row of its all-correct accuracy. The same as
    ``marft-jax table RUNS_DIR --tag after``."""
    from marft_jax.train.table import ALL_CORRECT, cell_stats

    out = []
    for m, rs in _by_method(rows).items():
        method, agents, roles = METHOD_ARMS[m]
        kinds = [(method, "accuracy_after")]
        if all(r.get("all_correct_after") is not None for r in rs):
            kinds.append((method + ALL_CORRECT, "all_correct_after"))
        for name, key in kinds:
            pooled: dict[str, list[float]] = {}
            for r in rs:
                pooled.setdefault(r.get("benchmark") or BENCHMARK, []).append(r[key])
            out.append({"method": name, "agents": agents, "roles": roles, "per_agent": {},
                        "cells": {b: cell_stats(v) for b, v in sorted(pooled.items())}})
    return out


def _kept_reading(path: Path) -> str:
    """The hand-written ``## Reading`` section of an earlier results.md (kept on rewrite)."""
    if not path.is_file():
        return READING_PLACEHOLDER
    text = path.read_text(encoding="utf-8")
    if "\n## Reading\n" not in text:
        return READING_PLACEHOLDER
    return text.split("\n## Reading\n", 1)[1].strip() or READING_PLACEHOLDER


def _results_md(rows: list[dict], stats: dict, table_md: str, command: str, wall: str,
                reading: str, figures: list[str]) -> str:
    from marft_jax.train.repro_stats import LEVEL, MIN_SEEDS, RESAMPLES, SEED
    from marft_jax.train.table import team_name

    team = lambda m: team_name(METHOD_ARMS[m][1])
    lines = [
        "# CPU reproduction: MARFT-A, MARFT-T, independent PPO and a single agent (Duo), MARFT-A and "
        "independent PPO (Trio), named vs anonymous roles",
        "",
        f"- Command: `{command}`",
        f"- Commit: {_commit()}; date {time.strftime('%Y-%m-%d')}",
        f"- Machine: {_machine()}",
        f"- {wall}; {len(rows)} runs{_sources(rows)}.",
        "- Model: SmolLM2-135M-Instruct (embedded GGUF), LoRA r8; task: generated arithmetic, level 1;",
        "  presets `experiments/configs/cpu_repro/*.yaml` (the same episodes per run); greedy held-out",
        "  team accuracy on the same problems before and after training.",
        "- Statistics: accuracies and changes in percentage points; mean ± standard error over seeds",
        f"  (sample std / √n); intervals: {LEVEL:.0%} percentile bootstrap ({RESAMPLES:,} resamples, seed "
        f"{SEED}), the seeds of each method resampled independently; \"not separated\": the interval holds 0;",
        f"  \"too few seeds\": a method has fewer than {MIN_SEEDS}.",
        "",
        "## Table (paper layout)",
        "",
        "Held-out accuracy after training: the team's (its answering agent's answer); for independent PPO",
        "the mean of the per-agent accuracies (reference §10), and beside it the fraction of problems that",
        "every agent answered correctly.",
        "",
        table_md.rstrip(),
        "",
        "## Change per method, against independent PPO of the same team size",
        "",
        "Single and Duo methods against Duo IPPO, Trio methods against Trio IPPO. Independent PPO's",
        "accuracy is the mean of its agents' accuracies.",
        "",
        "| method | team | seeds | before | after | change | change − IPPO's change | 95 % interval | verdict |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    vs = stats["vs_baseline"]
    for m, s in stats["methods"].items():
        c = vs.get(m)
        cmp_cells = (f"{c['estimate_pp']:+.1f} | {_interval(c)} | {c['verdict']}" if c
                     else ("(baseline) | – | –" if m in BASELINES.values() else "– | – | no baseline run"))
        lines.append(f"| {_label(m)} | {team(m)} | {s['n']} | {_pm(s['before_mean_pp'], s['before_se_pp'])} | "
                     f"{_pm(s['after_mean_pp'], s['after_se_pp'])} | "
                     f"{_pm(s['change_mean_pp'], s['change_se_pp'], signed=True)} | {cmp_cells} |")
    independent = {m: rs for m, rs in _by_method(rows).items()
                   if all(r.get("all_correct_after") is not None and r.get("all_correct_before") is not None
                          for r in rs)}
    if independent:
        from marft_jax.train.repro_stats import seed_summary

        lines += ["", "## Independent PPO: every agent correct", "",
                  "The fraction of problems that every agent answered correctly (the episode's verdict, not "
                  "compared above).", "",
                  "| method | team | seeds | before | after | change |", "|---|---|---:|---:|---:|---:|"]
        for m, rs in independent.items():
            ac = seed_summary([r["all_correct_before"] for r in rs], [r["all_correct_after"] for r in rs])
            lines.append(f"| {_label(m)} | {team(m)} | {ac['n']} | {_pm(ac['before_mean_pp'], ac['before_se_pp'])} | "
                         f"{_pm(ac['after_mean_pp'], ac['after_se_pp'])} | "
                         f"{_pm(ac['change_mean_pp'], ac['change_se_pp'], signed=True)} |")
    lines += ["", "## Stability", "",
              "Seed-to-seed spread: the sample std of the change over seeds; worst seed: the lowest change.", "",
              "| method | team | seeds | spread of the change | worst seed's change |", "|---|---|---:|---:|---:|"]
    for m, s in stats["methods"].items():
        lines.append(f"| {_label(m)} | {team(m)} | {s['n']} | {_num(s['change_std_pp'])} | {s['worst_change_pp']:+.1f} |")
    lines += ["", "## Comparisons", "",
              "| comparison | estimate (points) | 95 % interval | verdict |", "|---|---:|---:|---|"]
    for c in stats["spread"]:
        lines.append(f"| spread of the change: {_short(c['a'])} ({_num(c['std_a_pp'])}) − {_short(c['b'])} "
                     f"({_num(c['std_b_pp'])}); worst seeds {c['worst_a_pp']:+.1f} vs {c['worst_b_pp']:+.1f} | "
                     f"{_num(c['estimate_pp'], '+.1f')} | {_interval(c)} | {c['verdict']} |")
    for c in stats["margin"]:
        (a1, b1), (a2, b2) = c["small"], c["large"]
        lines.append(f"| margin over IPPO, {team(a2)} − {team(a1)}: ({_short(a2)} − {_short(b2)}: "
                     f"{c['margin_large_pp']:+.1f}) − ({_short(a1)} − {_short(b1)}: {c['margin_small_pp']:+.1f}) | "
                     f"{c['estimate_pp']:+.1f} | {_interval(c)} | {c['verdict']} |")
    for c in stats["differences"]:
        lines.append(f"| change of {_short(c['a'])} − change of {_short(c['b'])} | {c['estimate_pp']:+.1f} | "
                     f"{_interval(c)} | {c['verdict']} |")
    lines += ["", "## Per seed", "",
              "| method | seed | before | after | change | every agent correct: before → after | iterations | wall (s) "
              "| source |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        both = r.get("all_correct_before") is not None and r.get("all_correct_after") is not None
        all_correct = (f"{100 * r['all_correct_before']:.1f} → {100 * r['all_correct_after']:.1f}" if both else "–")
        lines.append(f"| {r['method']} | {r['seed']} | {100 * r['accuracy_before']:.1f} | "
                     f"{100 * r['accuracy_after']:.1f} | {100 * r['delta']:+.1f} | {all_correct} | {r['iterations']} | "
                     f"{r['wall_s'] if r['wall_s'] is not None else '–'} | {r.get('source') or 'run folder'} |")
    if figures:
        lines += ["", "## Figures", ""] + [f"![{f}]({f})" for f in figures]
    lines += ["", "## Reading", "", reading, ""]
    return "\n".join(lines)


def _sources(rows: list[dict]) -> str:
    """``(12 from run folders, 14 carried over from results.json of …)``; empty if all from run folders."""
    counts = Counter(r.get("source") or "run folder" for r in rows)
    folders = counts.pop("run folder", 0)
    if not counts:
        return ""
    parts = ([f"{folders} from run folders"] if folders else []) + [f"{n} carried over from {src}"
                                                                    for src, n in counts.items()]
    return " (" + ", ".join(parts) + ")"


def _figures(rows: list[dict], out: Path) -> list[str]:
    """heldout_accuracy.png and training_reward.png (mean ± 1 SE over seeds per method); the
    names of those written. A figure that fails is reported, never fatal."""
    from marft_jax.train.sweep_plot import HELDOUT_FILE, band_figure, team_line

    by = _by_method(rows)
    heldout = {_label(m): [r["heldout"] for r in rs if r.get("heldout")] for m, rs in by.items()}
    reward = {_label(m): [dict(enumerate(r["train_reward"], start=1)) for r in rs if r["train_reward"]]
              for m, rs in by.items()}
    specs = [(HELDOUT_FILE, heldout, "Held-out team accuracy (mean ± 1 SE over seeds)",
              "training iteration (0 = before training)", "accuracy (%)", 100.0),
             ("training_reward.png", reward, "Training reward (mean ± 1 SE over seeds)",
              "iteration", "mean episode reward", 1.0)]
    written = []
    for name, groups, title, xlabel, ylabel, scale in specs:
        if not any(groups.values()):
            continue
        try:
            band_figure(groups, out / name, title=title, xlabel=xlabel, ylabel=ylabel, scale=scale,
                        linestyles={_label(m): team_line(METHOD_ARMS[m][1]) for m in by})
            written.append(name)
        except Exception as e:  # the tables matter more than the pictures
            print(f"[cpu_repro] {name} failed: {e}", file=sys.stderr)
    return written


def write_results(rows: list[dict], out: Path, command: str, wall_s: float, runs_dir: Path | None = None,
                  aggregate_only: bool = False) -> None:
    """Write results.md, results.csv, results.json, table.tex and the figures into ``out``.

    Args:
      rows: one per finished run, as :func:`main` or :func:`collect_rows` build them (accuracies
        as fractions; ``train_reward`` per iteration; optional ``heldout``: iteration -> accuracy).
      command: the sweep's command line; wall_s: the sweep's wall time in seconds (with
        ``aggregate_only``: the sum of the runs' wall times).
      runs_dir: where the run folders are (adds the held-out curves); None: no held-out figure.
    A hand-written ``## Reading`` section of an existing results.md is kept.
    """
    from marft_jax.train.table import render

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["method", "seed", "accuracy_before", "accuracy_after", "delta",
                                          "all_correct_before", "all_correct_after", "iterations", "wall_s"])
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in w.fieldnames})
    stats = statistics(rows)
    table = paper_rows(rows)
    (out / "table.tex").write_text(render(table, "latex"), encoding="utf-8")
    wall = (f"Aggregated without training from the finished runs in `{runs_dir}` (each run's settings: its "
            f"`config.yaml`); the runs' wall times sum to {wall_s / 60:.0f} min" if aggregate_only
            else f"Sweep wall time {wall_s / 60:.0f} min")
    figures = _figures(rows, out)
    reading = _kept_reading(out / "results.md")
    (out / "results.md").write_text(_results_md(rows, stats, render(table, "markdown"), command, wall,
                                                reading, figures), encoding="utf-8")
    runs = [{**r, "heldout": {str(k): v for k, v in sorted(r.get("heldout", {}).items())}} for r in rows]
    (out / "results.json").write_text(json.dumps(_json_safe(
        {"command": command, "machine": _machine(), "commit": _commit(), "date": time.strftime("%Y-%m-%d"),
         "wall_s": wall_s, "aggregate_only": aggregate_only,
         "units": "accuracies in runs: fractions in [0, 1]; statistics: percentage points",
         "arms": {m: dict(zip(("method", "agents", "roles"), METHOD_ARMS[m])) for m in _by_method(rows)},
         "statistics": stats, "table": table, "runs": runs}), indent=2, allow_nan=False), encoding="utf-8")


def _json_safe(x):
    """NaN (an SE of one seed) as null: results.json stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _runs_bar(total: int):
    """The sweep's bar (runs done) on a terminal; each run's trainer adds its own bar of iterations
    below it. None elsewhere: then one line per run start and per iteration is printed."""
    if not sys.stdout.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="run", desc="runs", position=0, dynamic_ncols=True)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--runs-dir", default="runs/cpu_repro", help="where the run folders go")
    ap.add_argument("--out", default=str(REPO / "experiments" / "results" / "cpu_repro"),
                    help="where the results table and curves go")
    ap.add_argument("--no-compile-cache", action="store_true",
                    help="do not turn on JAX's persistent compilation cache (on by default)")
    ap.add_argument("--aggregate-only", action="store_true",
                    help="train nothing: write the results of the finished runs in --runs-dir")
    ap.add_argument("--prior-results", default=None,
                    help="a results.json of an earlier sweep: its runs join those of --runs-dir in the results")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    a = ap.parse_args(argv)
    bad = [o for o in a.overrides if "=" not in o]
    if bad:
        ap.error(f"overrides must be key=value, got {bad}")

    command = "python experiments/cpu_repro.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    prior = [] if a.prior_results is None else prior_rows(Path(a.prior_results), a.methods, a.seeds)
    if a.aggregate_only:
        return aggregate_only(Path(a.runs_dir).resolve(), Path(a.out), a.methods, a.seeds, command.strip(), prior)

    import jax

    from marft_jax.train.run_records import read_run

    runs_dir = Path(a.runs_dir).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    if not a.no_compile_cache:
        jax.config.update("jax_compilation_cache_dir", str(runs_dir / ".jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

    t0 = time.perf_counter()
    rows, untrained = [], known_untrained(runs_dir, a.overrides)
    plan = [(m, seed) for seed in a.seeds for m in a.methods]   # seed-major: a partial sweep covers every method
    bar = _runs_bar(len(plan))
    for k, (m, seed) in enumerate(plan):
        if bar is None:
            print(f"[cpu_repro] run {k + 1}/{len(plan)}: {m} seed {seed}", flush=True)
        else:
            bar.set_postfix_str(f"{m} seed {seed}")
        s = run_one(m, seed, a.overrides, runs_dir, untrained)
        if bar is not None:
            bar.update(1)
        rows.append(run_row(m, seed, read_run(Path(s["run_dir"]))))
        write_results(merge_rows(rows, prior), Path(a.out), command.strip(), time.perf_counter() - t0,
                      runs_dir=runs_dir)
    if bar is not None:
        bar.close()
    print(f"[cpu_repro] results in {a.out}/results.md", flush=True)
    return merge_rows(rows, prior)


def aggregate_only(runs_dir: Path, out: Path, methods, seeds, command: str,
                   prior: list[dict] | None = None) -> list[dict]:
    """``--aggregate-only``: the results of the finished runs of ``methods`` x ``seeds`` in
    ``runs_dir`` and the ``prior`` rows (of ``--prior-results``; a missing ``runs_dir`` is then
    allowed), without training (``command``: this command line, recorded as such)."""
    fresh = collect_rows(runs_dir, methods, seeds) if runs_dir.is_dir() or not prior else []
    rows = merge_rows(fresh, prior or [])
    if not rows:
        raise SystemExit(f"[cpu_repro] no finished run in {runs_dir} (a finished run is a folder "
                         f"<method>-s<seed> whose summary.json has accuracy_before and accuracy_after)")
    write_results(rows, out, command, sum(r["wall_s"] or 0.0 for r in rows), runs_dir=runs_dir,
                  aggregate_only=True)
    print(f"[cpu_repro] results of {len(rows)} finished runs in {out}/results.md", flush=True)
    return rows


if __name__ == "__main__":
    main()
