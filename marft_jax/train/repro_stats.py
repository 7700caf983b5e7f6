"""Statistics of a seed sweep: mean ± standard error, bootstrap intervals of differences between
methods, and the verdicts the reproduction reports (pure NumPy).

Units: inputs are accuracies as fractions in [0, 1], one value per seed. The building blocks
(:func:`mean_se`, :func:`bootstrap`, :func:`contrast`, :func:`spread_difference`) return values
in the units of their inputs; :func:`seed_summary` and :func:`sweep_report` return **percentage
points** (fraction × 100), named ``*_pp``.

Conventions:
- standard error (SE) = sample standard deviation (ddof=1) / √n; undefined (NaN) for n < 2;
- seed-to-seed spread = sample standard deviation (ddof=1) of the per-seed change;
- intervals are percentile bootstrap intervals (default 95 %, 10,000 resamples, seeded): every
  group's seeds are resampled with replacement independently of the other groups, and a group
  needs at least 3 seeds: with one, the resampled mean is a constant; with two, it takes three
  values, so the "95 %" interval is just the range of the seeds' combinations (a t interval of
  two seeds is ±12.7 SE wide). Both would be falsely narrow: such comparisons get no interval
  and the verdict ``too few seeds``;
- a verdict is ``not separated`` when the interval holds 0.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import numpy as np

RESAMPLES = 10_000
LEVEL = 0.95
SEED = 0
MIN_SEEDS = 3
NOT_SEPARATED = "not separated"
TOO_FEW = "too few seeds"
PP = 100.0                     # fraction -> percentage points


def _arr(x: Sequence[float]) -> np.ndarray:
    a = np.asarray(x, np.float64).reshape(-1)
    if a.size == 0:
        raise ValueError("a group of seeds is empty")
    return a


def mean_se(x: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (sample std / √n) of per-seed values; SE is NaN for one seed."""
    a = _arr(x)
    se = float(a.std(ddof=1) / math.sqrt(a.size)) if a.size >= 2 else math.nan
    return float(a.mean()), se


def sample_std(x: Sequence[float]) -> float:
    """Sample standard deviation (ddof=1) of per-seed values; NaN for one seed."""
    a = _arr(x)
    return float(a.std(ddof=1)) if a.size >= 2 else math.nan


def bootstrap(groups: Sequence[Sequence[float]], statistic: Callable[[list[np.ndarray]], np.ndarray], *,
              resamples: int = RESAMPLES, level: float = LEVEL, seed: int = SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic`` over independently resampled groups.

    Args:
      groups: per-seed values of each group (e.g. the change of method A, of method B).
      statistic: maps one ``[resamples, n_i]`` array per group to ``[resamples]`` values.
      resamples, level, seed: number of resamples, interval coverage in (0, 1), RNG seed (the
        same inputs and seed give the same interval).
    Returns: ``(low, high)`` in the statistic's units.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    draws = []
    for g in groups:
        a = _arr(g)
        draws.append(a[rng.integers(0, a.size, size=(resamples, a.size))])
    values = np.asarray(statistic(draws), np.float64)
    tail = 100.0 * (1.0 - level) / 2.0
    lo, hi = np.percentile(values, [tail, 100.0 - tail])
    return float(lo), float(hi)


def contrast(groups: Sequence[Sequence[float]], weights: Sequence[float], **kw) -> dict:
    """Interval of the weighted sum of group means, e.g. weights ``(1, -1)`` for mean(A) - mean(B)
    and ``(1, -1, -1, 1)`` for a difference of differences.

    Returns ``{"estimate", "low", "high"}`` in input units; ``low``/``high`` are None when a group
    has fewer than :data:`MIN_SEEDS` seeds. ``kw``: :func:`bootstrap`'s options.
    """
    if len(groups) != len(weights):
        raise ValueError(f"{len(groups)} groups but {len(weights)} weights")
    arrays = [_arr(g) for g in groups]
    estimate = float(sum(w * a.mean() for w, a in zip(weights, arrays)))
    if min(a.size for a in arrays) < MIN_SEEDS:
        return {"estimate": estimate, "low": None, "high": None}
    lo, hi = bootstrap(arrays, lambda d: sum(w * x.mean(axis=1) for w, x in zip(weights, d)), **kw)
    return {"estimate": estimate, "low": lo, "high": hi}


def spread_difference(a: Sequence[float], b: Sequence[float], **kw) -> dict:
    """Interval of sample_std(a) - sample_std(b) (negative: ``a`` varies less from seed to seed).
    Same return shape as :func:`contrast`, in input units."""
    a, b = _arr(a), _arr(b)
    if min(a.size, b.size) < MIN_SEEDS:
        return {"estimate": math.nan, "low": None, "high": None}
    lo, hi = bootstrap([a, b], lambda d: d[0].std(axis=1, ddof=1) - d[1].std(axis=1, ddof=1), **kw)
    return {"estimate": sample_std(a) - sample_std(b), "low": lo, "high": hi}


def verdict(interval: Mapping, above: str, below: str) -> str:
    """``above`` when the interval lies above 0, ``below`` when under 0, :data:`NOT_SEPARATED`
    when it holds 0, :data:`TOO_FEW` when there is no interval."""
    lo, hi = interval.get("low"), interval.get("high")
    if lo is None or hi is None:
        return TOO_FEW
    if lo > 0:
        return above
    if hi < 0:
        return below
    return NOT_SEPARATED


def _pp(interval: dict) -> dict:
    return {k: (None if v is None else v * PP) for k, v in interval.items()}


def seed_summary(before: Sequence[float], after: Sequence[float]) -> dict:
    """One method's seeds: accuracies before/after training (fractions, paired by seed).

    Returns, in percentage points: ``before_mean_pp``/``before_se_pp``, ``after_*``,
    ``change_*`` (after - before), ``change_std_pp`` (seed-to-seed spread), ``worst_change_pp``
    (the lowest seed's change); and ``n`` (seeds).
    """
    b, a = _arr(before), _arr(after)
    if b.size != a.size:
        raise ValueError(f"{b.size} accuracies before but {a.size} after")
    out: dict = {"n": int(a.size)}
    for name, x in (("before", b), ("after", a), ("change", a - b)):
        m, se = mean_se(x)
        out[f"{name}_mean_pp"], out[f"{name}_se_pp"] = m * PP, se * PP
    out["change_std_pp"] = sample_std(a - b) * PP
    out["worst_change_pp"] = float((a - b).min()) * PP
    return out


def sweep_report(changes: Mapping[str, Sequence[float]], *, baselines: Mapping[str, str],
                 spread_pairs: Sequence[tuple[str, str]] = (),
                 margin_pairs: Sequence[tuple[tuple[str, str], tuple[str, str]]] = (),
                 differences: Sequence[tuple[str, str]] = (), baseline_name: str = "IPPO",
                 names: Mapping[str, str] | None = None, **kw) -> dict:
    """The comparisons of a sweep, from each method's per-seed change (after - before, fractions).

    Args:
      changes: method -> per-seed change. Methods named below but absent here are skipped.
      baselines: method -> its baseline (the same team size's IPPO): the interval of
        mean change(method) - mean change(baseline), verdict ``above/below <baseline_name>``.
      spread_pairs: ``(a, b)``: seed-to-seed spread of the change, std(a) - std(b), with the worst
        seed of each; verdict ``<a> steadier`` (interval under 0) / ``<b> steadier``.
      margin_pairs: ``((a_small, b_small), (a_large, b_large))``: how the margin a - b changes
        from the smaller team to the larger, (a_large - b_large) - (a_small - b_small); verdict
        ``margin wider`` / ``margin narrower``.
      differences: ``(a, b)``: mean change(a) - mean change(b); verdict ``<a> above <b>`` / below.
      names: method -> the name verdicts use (default: the method key).
      kw: :func:`bootstrap` options (each interval restarts the RNG from the same seed, so one
        comparison does not depend on which others are computed).
    Returns: ``{"vs_baseline": {method: {...}}, "spread": [...], "margin": [...],
    "differences": [...]}``; every interval dict holds ``estimate_pp``, ``low_pp``, ``high_pp``
    (percentage points, low/high None without enough seeds) and ``verdict``.
    """
    have = lambda *methods: all(m in changes for m in methods)
    name = lambda m: (names or {}).get(m, m)
    vs = {}
    for m, base in baselines.items():
        if have(m, base):
            iv = contrast([changes[m], changes[base]], [1, -1], **kw)
            vs[m] = {"baseline": base, **_named(iv),
                     "verdict": verdict(iv, f"above {baseline_name}", f"below {baseline_name}")}
    spread = []
    for a, b in spread_pairs:
        if have(a, b):
            iv = spread_difference(changes[a], changes[b], **kw)
            spread.append({"a": a, "b": b, "std_a_pp": sample_std(changes[a]) * PP,
                           "std_b_pp": sample_std(changes[b]) * PP,
                           "worst_a_pp": float(np.min(changes[a])) * PP,
                           "worst_b_pp": float(np.min(changes[b])) * PP, **_named(iv),
                           "verdict": verdict(iv, f"{name(b)} steadier", f"{name(a)} steadier")})
    margin = []
    for (a1, b1), (a2, b2) in margin_pairs:
        if have(a1, b1, a2, b2):
            iv = contrast([changes[a2], changes[b2], changes[a1], changes[b1]], [1, -1, -1, 1], **kw)
            margin.append({"small": [a1, b1], "large": [a2, b2],
                           "margin_small_pp": float(np.mean(changes[a1]) - np.mean(changes[b1])) * PP,
                           "margin_large_pp": float(np.mean(changes[a2]) - np.mean(changes[b2])) * PP,
                           **_named(iv), "verdict": verdict(iv, "margin wider", "margin narrower")})
    diffs = []
    for a, b in differences:
        if have(a, b):
            iv = contrast([changes[a], changes[b]], [1, -1], **kw)
            diffs.append({"a": a, "b": b, **_named(iv), "verdict": verdict(iv, f"{name(a)} above {name(b)}",
                                                                   f"{name(a)} below {name(b)}")})
    return {"vs_baseline": vs, "spread": spread, "margin": margin, "differences": diffs}


def _named(interval: dict) -> dict:
    return {f"{k}_pp": v for k, v in _pp(interval).items()}
