"""Training curves from a run's ``metrics.jsonl`` as PNG files (matplotlib, Agg, no display).

``plot_run(run_dir)`` writes one figure per panel whose metrics exist, into ``run_dir/plots/``:
reward (``rewards/*``), accuracy (``episode/accuracy``, ``eval/*accuracy*``), losses
(``actor/*/pg_loss``, ``critic/value_loss``), KL (``actor/*/approx_kl``), throughput
(``perf/*``) and timing (``timing_s/*``). Records of the same step merge (a later value of a
key wins). Curves over many runs (mean ± SE per method) are :mod:`marft_jax.train.sweep_plot`'s.
"""

from __future__ import annotations

import fnmatch
import math
from pathlib import Path

from marft_jax.train.metrics import METRICS_FILE, read_metrics

PLOTS_DIR = "plots"

# (file stem, title, y label, glob patterns)
PANELS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("reward", "Reward per agent", "mean reward", ("rewards/*",)),
    ("accuracy", "Accuracy", "accuracy", ("episode/accuracy", "eval/*accuracy*")),
    ("losses", "Losses", "loss", ("actor/*/pg_loss", "critic/value_loss")),
    ("kl", "Approximate KL (old vs new policy)", "KL", ("actor/*/approx_kl",)),
    ("throughput", "Throughput", "tokens / s", ("perf/throughput",)),
    ("mfu", "Model FLOPs utilisation", "MFU", ("perf/mfu",)),
    ("timing", "Stage time", "seconds", ("timing_s/*",)),
)


def _series(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    by_step: dict[int, dict] = {}
    for r in records:
        # Records of one step merge (the trainer logs an evaluation apart from the iteration's
        # metrics); on a key logged twice the later line wins.
        by_step.setdefault(int(r["step"]), {}).update(r)
    out: dict[str, tuple[list[int], list[float]]] = {}
    for step in sorted(by_step):
        for k, v in by_step[step].items():
            if k in ("step", "time") or isinstance(v, (bool, list, dict)) or v is None:
                continue
            try:
                y = float(v)  # "nan"/"inf" strings included
            except (TypeError, ValueError):
                continue
            xs, ys = out.setdefault(k, ([], []))
            xs.append(step)
            ys.append(y)
    return out


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write PNG curves of ``run_dir/metrics.jsonl`` to ``run_dir/plots/``; returns the files.

    Raises FileNotFoundError when the metrics file is missing, ValueError when it holds no
    numeric metric.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg canvas; pyplot untouched
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"plot_run: {str(path)!r} does not exist (nothing logged yet?)")
    series = _series(read_metrics(run_dir))
    if not series:
        raise ValueError(f"plot_run: {str(path)!r} holds no numeric metrics")
    out_dir = run_dir / PLOTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, title, ylabel, patterns in PANELS:
        keys = sorted(k for k in series if any(fnmatch.fnmatchcase(k, p) for p in patterns))
        keys = [k for k in keys if any(math.isfinite(y) for y in series[k][1])]
        if not keys:
            continue
        fig = Figure(figsize=(7, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        for k in keys:
            xs, ys = series[k]
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=k)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        target = out_dir / f"{stem}.png"
        fig.savefig(target)
        written.append(target)
    if not written:
        raise ValueError(f"plot_run: {str(path)!r} has none of the plotted metrics "
                         f"({', '.join(p for _, _, _, ps in PANELS for p in ps)})")
    return written
