"""Trajectory-level tests of a sampler against the exact per-step distribution.

A sampler can be exact at every single position (one position's draws match ``softmax(z / T)``
after top-k / top-p) and still produce trajectories the model would not: a draw reused across
steps, a cache row read by the wrong sequence after compaction, a position id off by one after
a row finishes. These tests take finished samples and, for every generated position, the exact
next-token distribution **recomputed by a teacher-forced forward over the sample's own prefix**
(an independent program: no KV cache, no sampler), and check two things that hold for an exact
sampler whatever the model:

* **Stop martingale**: at each generated position ``t`` of a row, ``1[token_t is a stop] -
  P_t(stop)`` has mean 0 given the past; summed over every position of every row it is a
  martingale with variance ``Σ P_t(stop)(1 - P_t(stop))``. ``z`` = sum / sqrt(variance) is
  approximately standard normal; ``z << 0``: the sampler stops less often than the model does
  (its responses run long).
* **Randomized PIT**: ``u_t = F_t(token_t - 1) + V · P_t(token_t)`` (token-id order, ``V``
  uniform) is i.i.d. uniform on (0, 1) under an exact sampler (Brockwell 2007); the
  Kolmogorov-Smirnov distance of all ``u_t`` from uniform and its asymptotic p-value test every
  token's marginal, and the lag-1 correlation within rows tests their independence.

Responses that hit the token budget are censored: their positions count (the model did not stop
there), nothing after them does. Pure NumPy; the callers bring the logits.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np


def step_distribution(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """``[T, V]`` float64 probabilities of the sampling distribution at each row of ``logits``
    ``[T, V]``: ``softmax(logits / T)`` restricted to the top ``top_k`` (0: all) and then to the
    smallest nucleus of mass ``top_p`` (ties at a threshold kept, as the sampler keeps them)."""
    z = np.asarray(logits, np.float64) / float(temperature)
    if top_k:
        kth = np.sort(z, axis=-1)[:, -top_k][:, None]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p < 1.0:
        order = np.sort(p, axis=-1)[:, ::-1]
        mass = np.cumsum(order, axis=-1)
        cut = np.argmax(mass >= top_p, axis=-1)                      # the last entry the nucleus needs
        tau = np.take_along_axis(order, cut[:, None], axis=-1)
        p = np.where(p >= tau, p, 0.0)
        p /= p.sum(-1, keepdims=True)
    return p


def stop_martingale(probs: Iterable[np.ndarray], tokens: Iterable[Sequence[int]], stop_ids: Sequence[int]) -> dict:
    """The stop martingale over rows: ``probs`` one ``[T_r, V]`` per row (the exact distribution
    at each generated position), ``tokens`` the row's ``T_r`` generated tokens. Returns
    ``{"z", "observed", "expected", "variance", "positions", "rows"}``."""
    stops = np.asarray(list(stop_ids), np.int64)
    observed = expected = variance = 0.0
    positions = rows = 0
    for p, toks in zip(probs, tokens):
        toks = np.asarray(toks, np.int64)
        ps = p[:, stops].sum(-1)
        observed += float(np.isin(toks, stops).sum())
        expected += float(ps.sum())
        variance += float((ps * (1.0 - ps)).sum())
        positions += len(toks)
        rows += 1
    z = (observed - expected) / math.sqrt(variance) if variance > 0 else 0.0
    return {"z": z, "observed": observed, "expected": expected, "variance": variance,
            "positions": positions, "rows": rows}


def randomized_pit(probs: Iterable[np.ndarray], tokens: Iterable[Sequence[int]],
                   rng: np.random.Generator) -> list[np.ndarray]:
    """Per row, ``u_t = F_t(token_t - 1) + V · P_t(token_t)`` at each generated position."""
    out = []
    for p, toks in zip(probs, tokens):
        toks = np.asarray(toks, np.int64)
        cdf_before = np.cumsum(p, axis=-1) - p                      # F(token - 1) per entry
        idx = np.arange(len(toks))
        out.append(cdf_before[idx, toks] + rng.random(len(toks)) * p[idx, toks])
    return out


def lag1_correlation(u_rows: Sequence[np.ndarray]) -> dict:
    """Pooled correlation of consecutive PIT values within rows (``u_t``, ``u_{t+1}``): 0 for an
    exact sampler, whose draws are independent given the past; ``z`` = r * sqrt(pairs). A draw
    reused across steps shows here even when every marginal is right."""
    a = np.concatenate([u[:-1] for u in u_rows if len(u) > 1] or [np.zeros(0)])
    b = np.concatenate([u[1:] for u in u_rows if len(u) > 1] or [np.zeros(0)])
    if len(a) < 3:
        return {"r": 0.0, "z": 0.0, "pairs": int(len(a))}
    r = float(np.corrcoef(a, b)[0, 1])
    return {"r": r, "z": r * math.sqrt(len(a)), "pairs": int(len(a))}


def ks_uniform(u: np.ndarray) -> dict:
    """Kolmogorov-Smirnov distance of ``u`` from Uniform(0, 1) and its asymptotic p-value."""
    u = np.sort(np.clip(np.asarray(u, np.float64), 0.0, 1.0))
    n = len(u)
    if n == 0:
        return {"d": 0.0, "p_value": 1.0, "n": 0}
    i = np.arange(1, n + 1)
    d = float(max((i / n - u).max(), (u - (i - 1) / n).max()))
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d             # Stephens' correction
    p = 2.0 * sum((-1) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam) for k in range(1, 101))
    return {"d": d, "p_value": float(min(max(p, 0.0), 1.0)), "n": n}
