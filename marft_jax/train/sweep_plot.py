"""Figures over many runs: one curve per method, the mean over its seeds with a band of ±1
standard error (matplotlib, Agg, no display).

:func:`plot_heldout` reads run folders (or sweep folders of run folders) and draws the held-out
team accuracy against the training iteration (0 = before training, the periodic evaluations,
the last iteration = after), methods grouped by the eval files' method/agents/roles.
:func:`band_figure` draws any such curves (``experiments/cpu_repro.py`` draws the training
reward with it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from marft_jax.train.repro_stats import mean_se
from marft_jax.train.run_records import Arm, RunRecord, read_runs
from marft_jax.train.table import method_rank, team_name

HELDOUT_FILE = "heldout_accuracy.png"


TEAM_LINES = {1: ":", 2: "-", 3: "--"}          # team size -> line style (others: dash-dot)


def team_line(agents: int) -> str:
    return TEAM_LINES.get(agents, "-.")


def arm_label(arm: Arm) -> str:
    """``"MARFT-A · Duo"``, ``"MARFT-A · Duo · anonymous"``: a legend entry."""
    return f"{arm.method} · {team_name(arm.agents)}" + (" · anonymous" if arm.roles == "anonymous" else "")


def mean_band(curves: Sequence[Mapping[int, float]]) -> tuple[list[int], list[float], list[float], list[int]]:
    """Per x (sorted union of the curves' x): the mean and standard error over the curves that
    have a value there, and their number. SE is NaN where only one curve has the x.
    Returns ``(xs, means, ses, counts)`` in the curves' units."""
    xs = sorted({x for c in curves for x in c})
    means, ses, counts = [], [], []
    for x in xs:
        values = [c[x] for c in curves if x in c]
        m, se = mean_se(values)
        means.append(m)
        ses.append(se)
        counts.append(len(values))
    return xs, means, ses, counts


def band_figure(groups: Mapping[str, Sequence[Mapping[int, float]]], path: str | Path, *, title: str,
                xlabel: str, ylabel: str, scale: float = 1.0, linestyles: Mapping[str, str] | None = None) -> Path:
    """One PNG: for each label, the mean curve over its seeds' curves (x -> value, ×``scale``)
    with a ±1 SE band (no band where one seed has the x); ``linestyles``: label -> matplotlib
    line style (default solid). Raises ValueError with no curve."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg canvas; pyplot untouched
    from matplotlib.figure import Figure

    groups = {k: [c for c in v if c] for k, v in groups.items()}
    groups = {k: v for k, v in groups.items() if v}
    if not groups:
        raise ValueError(f"band_figure: no curve to draw for {str(path)!r}")
    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for label, curves in groups.items():
        xs, means, ses, _ = mean_band(curves)
        ys = [m * scale for m in means]
        line, = ax.plot(xs, ys, marker="o", markersize=3, label=f"{label} (n={len(curves)})",
                        linestyle=(linestyles or {}).get(label, "-"))
        lo = [y - (s * scale if math.isfinite(s) else 0.0) for y, s in zip(ys, ses)]
        hi = [y + (s * scale if math.isfinite(s) else 0.0) for y, s in zip(ys, ses)]
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def heldout_groups(records: Iterable[RunRecord]) -> dict[Arm, list[dict[int, float]]]:
    """Arm -> the held-out curves of its runs (runs without a trained evaluation yet have no
    arm and are left out), arms in the table's order (team, then method)."""
    groups: dict[Arm, list[dict[int, float]]] = {}
    for r in records:
        if r.arm is not None and r.curve:
            groups.setdefault(r.arm, []).append(r.curve)
    order = sorted(groups, key=lambda a: (a.agents, method_rank(a.method), a.method, a.roles != "named"))
    return {a: groups[a] for a in order}


def plot_heldout(paths: Iterable[str | Path], out: str | Path = HELDOUT_FILE) -> Path:
    """Mean held-out accuracy (%) per method against the iteration, ±1 SE over seeds, from run
    folders or sweep folders; writes ``out`` (PNG) and returns it. Raises FileNotFoundError for a
    missing folder, ValueError when no run has a trained evaluation yet."""
    paths = list(paths)
    groups = heldout_groups(read_runs(paths))
    if not groups:
        raise ValueError("plot: no run under " + ", ".join(repr(str(p)) for p in paths)
                         + " has a trained evaluation yet (eval/after.json or eval/periodic/iter*.json)")
    return band_figure({arm_label(a): c for a, c in groups.items()}, out,
                       title="Held-out team accuracy (mean ± 1 SE over seeds)",
                       xlabel="training iteration (0 = before training)", ylabel="accuracy (%)", scale=100.0,
                       linestyles={arm_label(a): team_line(a.agents) for a in groups})
