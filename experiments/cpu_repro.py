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

Writes to ``--out`` (small files, meant to be committed): ``results.md`` (table + per-seed rows +
the exact command, machine and commit), ``results.csv``, ``results.json`` and
``training_reward.png`` (mean training reward per iteration, one curve per method).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

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


def _rewards(run_dir: Path) -> list[float]:
    """Training reward (``episode/score_mean``) per iteration from the run's metrics.jsonl."""
    out: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "episode/score_mean" in rec:
                out[int(rec["step"])] = float(rec["episode/score_mean"])
    return [out[k] for k in sorted(out)]


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
    if summary_path.exists():
        done = json.loads(summary_path.read_text())
        if done.get("accuracy_after") is not None and done.get("accuracy_before") is not None:
            print(f"[cpu_repro] {method} seed {seed}: reusing {run_dir}", flush=True)
            untrained.setdefault(key, (done["accuracy_before"], run_dir.name))
            return done
    shared = untrained.get(key)
    if shared is not None:
        cfg.train.eval_before = False
    t0 = time.perf_counter()
    summary = train(cfg)
    if summary.get("accuracy_after") is None:      # stopped by a signal: its checkpoint resumes it
        raise SystemExit(f"[cpu_repro] {method} seed {seed} stopped at iteration {summary['iterations']} "
                         f"({run_dir}); run the same command again to resume")
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    if shared is not None:
        summary["accuracy_before"], summary["accuracy_before_from"] = shared
    else:
        untrained[key] = (summary["accuracy_before"], run_dir.name)
    summary_path.write_text(json.dumps(summary, indent=2))
    print(f"[cpu_repro] {method} seed {seed}: {summary['accuracy_before']:.3f} -> "
          f"{summary.get('accuracy_after', float('nan')):.3f} in {summary['wall_s']:.0f}s "
          f"({summary['iterations']} iterations)", flush=True)
    return summary


def _fmt(xs: list[float]) -> str:
    return f"{100 * np.mean(xs):.1f} ± {100 * np.std(xs):.1f}"


def write_results(rows: list[dict], out: Path, command: str, wall_s: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["method", "seed", "accuracy_before", "accuracy_after",
                                          "delta", "iterations", "wall_s"])
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in w.fieldnames})
    (out / "results.json").write_text(json.dumps(
        {"command": command, "machine": _machine(), "commit": _commit(), "wall_s": wall_s, "runs": rows},
        indent=2))

    lines = [
        "# CPU mini-reproduction: MARFT-A vs MARFT-T vs independent PPO vs single agent",
        "",
        f"- Command: `{command}`",
        f"- Machine: {_machine()}",
        f"- Commit: {_commit()}; date {time.strftime('%Y-%m-%d')}; sweep wall time {wall_s / 60:.0f} min",
        "- Model: SmolLM2-135M-Instruct (embedded GGUF), LoRA r8; task: generated arithmetic, level 1;",
        "  presets `experiments/configs/cpu_repro/*.yaml` (identical budgets); greedy held-out accuracy",
        "  on the same problems before and after training; mean ± population std over seeds, in %.",
        "",
        "| method | seeds | accuracy before | accuracy after | change (points) | iterations |",
        "|---|---|---|---|---|---|",
    ]
    for m, label in METHODS.items():
        rs = [r for r in rows if r["method"] == m]
        if not rs:
            continue
        before = [r["accuracy_before"] for r in rs]
        after = [r["accuracy_after"] for r in rs]
        delta = [a - b for a, b in zip(after, before)]
        lines.append(f"| {label} | {len(rs)} | {_fmt(before)} | {_fmt(after)} | "
                     f"{100 * np.mean(delta):+.1f} ± {100 * np.std(delta):.1f} | "
                     f"{np.mean([r['iterations'] for r in rs]):.1f} |")
    lines += ["", "Per run:", "", "| method | seed | before | after | iterations | wall (s) |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['seed']} | {100 * r['accuracy_before']:.1f} | "
                     f"{100 * r['accuracy_after']:.1f} | {r['iterations']} | {r['wall_s']} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        for m, label in METHODS.items():
            curves = [r["train_reward"] for r in rows if r["method"] == m and r["train_reward"]]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            ax.plot(np.arange(1, n + 1), np.mean([c[:n] for c in curves], axis=0), marker="o", label=label)
        ax.set_xlabel("iteration")
        ax.set_ylabel("training reward (mean over seeds)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "training_reward.png")
        plt.close(fig)
    except Exception as e:  # the table matters more than the picture
        print(f"[cpu_repro] plot failed: {e}", file=sys.stderr)


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
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    a = ap.parse_args(argv)
    bad = [o for o in a.overrides if "=" not in o]
    if bad:
        ap.error(f"overrides must be key=value, got {bad}")

    import jax

    runs_dir = Path(a.runs_dir).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    if not a.no_compile_cache:
        jax.config.update("jax_compilation_cache_dir", str(runs_dir / ".jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

    command = "python experiments/cpu_repro.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    rows, untrained = [], {}
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
        rows.append({"method": m, "seed": seed, "accuracy_before": s["accuracy_before"],
                     "accuracy_after": s["accuracy_after"],
                     "delta": s["accuracy_after"] - s["accuracy_before"],
                     "iterations": s["iterations"], "wall_s": s.get("wall_s"),
                     "train_reward": _rewards(Path(s["run_dir"]))})
        write_results(rows, Path(a.out), command.strip(), time.perf_counter() - t0)
    if bar is not None:
        bar.close()
    print(f"[cpu_repro] results in {a.out}/results.md", flush=True)
    return rows


if __name__ == "__main__":
    main()
