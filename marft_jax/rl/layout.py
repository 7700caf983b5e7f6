"""The canonical axis order of trajectory arrays, written once.

Every trajectory array is ``[step, batch, agent, token]`` (token level), ``[step, batch, agent]``
(action level) or ``[step, batch]`` (per step), optionally followed by feature axes (e.g.
``hidden``). The step axis is always present (S = 1 for single-step tasks).

Backups read one row (= one episode) as a single sequence of decision points in *execution
order* step -> agent -> token. :func:`flatten_decisions` / :func:`unflatten_decisions` (and
their time-major twins for scans, :func:`time_major_decisions`) are the only place that
reshape/transpose is written; :func:`flatten_agent_sequences` /
:func:`unflatten_agent_sequences` (and :func:`time_major_agent_sequences`) are the only place
the per-agent (independent PPO) view is written. Flat row ``r`` of the per-agent view is
``(batch r // N, agent r % N)``. Rows of responses (contexts, features), of (row, agent) pairs
and the agent-major view of the update are written in :func:`flatten_responses`,
:func:`flatten_agents` and :func:`agent_major` (with their inverses), and the episode's last
played step in :func:`last_played_step`.

Masks are derived from lengths / ``act_mask``, never by comparing token ids with a pad id.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

# Axis names and positions of the canonical layout.
STEP, BATCH, AGENT, TOKEN = "step", "batch", "agent", "token"
STEP_AXIS, BATCH_AXIS, AGENT_AXIS, TOKEN_AXIS = 0, 1, 2, 3

STEP_AXES: tuple[str, ...] = (STEP, BATCH)                       # [S, B]
ACTION_AXES: tuple[str, ...] = (STEP, BATCH, AGENT)              # [S, B, N]
TOKEN_AXES: tuple[str, ...] = (STEP, BATCH, AGENT, TOKEN)        # [S, B, N, K]

LEVELS = ("action", "token")


def _num_decision_axes(level: str) -> int:
    """Axes of a decision point besides batch: action (step, agent), token (step, agent, token)."""
    if level == "action":
        return 2
    if level == "token":
        return 3
    raise ValueError(f"level must be one of {LEVELS}, got {level!r}")


def level_of(x: jax.Array | Any, *, trailing: int = 0) -> str:
    """``"action"`` for a ``[S, B, N, *trailing]`` array, ``"token"`` for ``[S, B, N, K, *trailing]``."""
    rank = jnp.ndim(x) - trailing
    if rank == 3:
        return "action"
    if rank == 4:
        return "token"
    raise ValueError(f"expected rank 3 (action) or 4 (token) plus {trailing} trailing axes, "
                     f"got shape {jnp.shape(x)}")


def assert_layout(
    x: jax.Array | Any,
    name: str,
    axes: Sequence[str],
    *,
    sizes: Mapping[str, int] | None = None,
    dtype: Any = None,
) -> dict[str, int]:
    """Asserts that ``x`` has one axis per name in ``axes`` (e.g. :data:`TOKEN_AXES`).

    Args:
      x: the array to check.
      name: the array's name, used in the error message.
      axes: axis names in order, e.g. ``TOKEN_AXES`` or ``(*ACTION_AXES, "hidden")``.
      sizes: optional ``{axis name: size}``; every axis of ``x`` whose name appears there must
        have that size (pass the dict returned by an earlier call to check consistency).
      dtype: optional dtype or dtype kind accepted by ``chex.assert_type`` (``jnp.floating``,
        ``bool``, ``jnp.integer``, ``jnp.float32``...).

    Returns:
      ``{axis name: size}`` of ``x``, merged over ``sizes``.

    Raises:
      AssertionError naming ``name`` on a rank, size or dtype mismatch. Works under ``jit``
      (shapes and dtypes are static).
    """
    axes = tuple(axes)
    known = dict(sizes or {})
    expected = tuple(known.get(a) for a in axes)
    try:
        chex.assert_rank(x, len(axes))
        chex.assert_shape(x, expected)
        if dtype is not None:
            chex.assert_type(x, dtype)
    except AssertionError as err:
        raise AssertionError(
            f"{name}: expected axes {list(axes)} with sizes {dict(zip(axes, expected))}"
            f"{'' if dtype is None else f' and dtype {dtype}'}, got shape {jnp.shape(x)} "
            f"dtype {jnp.result_type(x)} ({err})") from None
    known.update(zip(axes, jnp.shape(x)))
    return known


# ----------------------------------------------------------------------------------------------
# Execution-order flattening (MARFT backups).


def flatten_decisions(x: jax.Array, level: str = "token") -> jax.Array:
    """Per-row sequences of decision points in execution order step -> agent -> token.

    Args:
      x: ``[S, B, N, K, *rest]`` (token level) or ``[S, B, N, *rest]`` (action level).
      level: ``"token"`` or ``"action"``.

    Returns:
      ``[B, P, *rest]`` with ``P = S*N*K`` (token) or ``S*N`` (action); flat index
      ``p = (s*N + i)*K + k`` (token) or ``s*N + i`` (action). Same dtype.
    """
    d = _num_decision_axes(level)
    shape = jnp.shape(x)
    if len(shape) < d + 1:
        raise ValueError(f"flatten_decisions({level}): rank {len(shape)} < {d + 1}")
    x = jnp.moveaxis(x, BATCH_AXIS, 0)                       # [B, S, N, (K), *rest]
    b = shape[BATCH_AXIS]
    dec = (shape[0],) + tuple(shape[2:d + 1])
    p = 1
    for n in dec:
        p *= n
    return x.reshape((b, p) + tuple(shape[d + 1:]))


def unflatten_decisions(x: jax.Array, decision_shape: Sequence[int]) -> jax.Array:
    """Inverse of :func:`flatten_decisions`.

    Args:
      x: ``[B, P, *rest]``.
      decision_shape: ``(S, N, K)`` (token level) or ``(S, N)`` (action level), ``P`` = product.

    Returns:
      ``[S, B, N, K, *rest]`` or ``[S, B, N, *rest]``.
    """
    decision_shape = tuple(int(n) for n in decision_shape)
    if len(decision_shape) not in (2, 3):
        raise ValueError(f"decision_shape must be (S, N) or (S, N, K), got {decision_shape}")
    shape = jnp.shape(x)
    x = x.reshape((shape[0],) + decision_shape + tuple(shape[2:]))   # [B, S, N, (K), *rest]
    return jnp.moveaxis(x, 0, BATCH_AXIS)


def time_major_decisions(x: jax.Array, level: str = "token") -> jax.Array:
    """Time-major view of :func:`flatten_decisions` for a scan over decision points.

    ``[S, B, N, K, *rest]`` -> ``[P, B, *rest]`` (``[S, B, N, *rest]`` -> ``[S*N, B, *rest]`` at
    action level) with one transpose; ``p`` as in :func:`flatten_decisions`. Keep this view
    inside the scan that needs it.
    """
    d = _num_decision_axes(level)
    shape = jnp.shape(x)
    dec = (shape[0],) + tuple(shape[2:d + 1])
    x = jnp.moveaxis(x, BATCH_AXIS, d)                       # [S, N, (K), B, *rest]
    p = 1
    for n in dec:
        p *= n
    return x.reshape((p, shape[BATCH_AXIS]) + tuple(shape[d + 1:]))


def from_time_major_decisions(x: jax.Array, decision_shape: Sequence[int]) -> jax.Array:
    """Inverse of :func:`time_major_decisions`: ``[P, B, *rest]`` -> ``[S, B, N, (K), *rest]``."""
    decision_shape = tuple(int(n) for n in decision_shape)
    shape = jnp.shape(x)
    x = x.reshape(decision_shape + tuple(shape[1:]))         # [S, N, (K), B, *rest]
    return jnp.moveaxis(x, len(decision_shape), BATCH_AXIS)


# ----------------------------------------------------------------------------------------------
# Per-agent flattening (independent PPO: agent i at step s links to agent i at step s+1).


def flatten_agent_sequences(x: jax.Array, level: str = "token") -> jax.Array:
    """Per-(row, agent) sequences over the agent's own decision points, step -> token.

    Args:
      x: ``[S, B, N, K, *rest]`` (token) or ``[S, B, N, *rest]`` (action).

    Returns:
      ``[B*N, P_i, *rest]`` with ``P_i = S*K`` (token) or ``S`` (action); flat row
      ``r = b*N + i``, flat index ``q = s*K + k`` (token) or ``s`` (action).
    """
    d = _num_decision_axes(level)
    shape = jnp.shape(x)
    s, b, n = shape[0], shape[1], shape[2]
    k = shape[3] if d == 3 else 1
    rest = tuple(shape[d + 1:])
    x = x.reshape((s, b, n, k) + rest)
    x = jnp.moveaxis(x, (1, 2), (0, 1))                     # [B, N, S, K, *rest]
    return x.reshape((b * n, s * k) + rest)


def unflatten_agent_sequences(x: jax.Array, decision_shape: Sequence[int]) -> jax.Array:
    """Inverse of :func:`flatten_agent_sequences`.

    Args:
      x: ``[B*N, P_i, *rest]``.
      decision_shape: ``(S, N, K)`` (token level) or ``(S, N)`` (action level).
    """
    decision_shape = tuple(int(n) for n in decision_shape)
    if len(decision_shape) not in (2, 3):
        raise ValueError(f"decision_shape must be (S, N) or (S, N, K), got {decision_shape}")
    s, n = decision_shape[0], decision_shape[1]
    k = decision_shape[2] if len(decision_shape) == 3 else 1
    shape = jnp.shape(x)
    rest = tuple(shape[2:])
    b = shape[0] // n
    x = x.reshape((b, n, s, k) + rest)
    x = jnp.moveaxis(x, (0, 1), (1, 2))                     # [S, B, N, K, *rest]
    if len(decision_shape) == 2:
        x = x.reshape((s, b, n) + rest)
    return x


def time_major_agent_sequences(x: jax.Array, level: str = "token") -> jax.Array:
    """Time-major view of :func:`flatten_agent_sequences`: ``[S, B, N, (K), *rest]`` ->
    ``[S*K (or S), B*N, *rest]`` with column ``b*N + i``. Keep it inside the scan that needs it."""
    d = _num_decision_axes(level)
    shape = jnp.shape(x)
    s, b, n = shape[0], shape[1], shape[2]
    k = shape[3] if d == 3 else 1
    rest = tuple(shape[d + 1:])
    x = x.reshape((s, b, n, k) + rest)
    x = jnp.moveaxis(x, 3, 1)                                # [S, K, B, N, *rest]
    return x.reshape((s * k, b * n) + rest)


def from_time_major_agent_sequences(x: jax.Array, decision_shape: Sequence[int]) -> jax.Array:
    """Inverse of :func:`time_major_agent_sequences`."""
    decision_shape = tuple(int(n) for n in decision_shape)
    s, n = decision_shape[0], decision_shape[1]
    k = decision_shape[2] if len(decision_shape) == 3 else 1
    shape = jnp.shape(x)
    rest = tuple(shape[2:])
    b = shape[1] // n
    x = jnp.moveaxis(x.reshape((s, k, b, n) + rest), 1, 3)   # [S, B, N, K, *rest]
    if len(decision_shape) == 2:
        x = x.reshape((s, b, n) + rest)
    return x


# ----------------------------------------------------------------------------------------------
# Response rows: one row per response (step, row, agent), per (row, agent), or per agent.
# These take NumPy arrays (host-side packing) and JAX arrays alike and return the same kind.


def _moveaxis(x, source, destination):
    return (np.moveaxis if isinstance(x, np.ndarray) else jnp.moveaxis)(x, source, destination)


def flatten_responses(x: jax.Array) -> jax.Array:
    """``[S, B, N, *rest]`` -> ``[S*B*N, *rest]``: one row per response (a context, a feature
    vector), flat row ``r = (s*B + b)*N + i``."""
    shape = jnp.shape(x)
    return x.reshape((shape[0] * shape[1] * shape[2],) + tuple(shape[3:]))


def unflatten_responses(x: jax.Array, response_shape: Sequence[int]) -> jax.Array:
    """Inverse of :func:`flatten_responses`: ``[S*B*N, *rest]`` -> ``[S, B, N, *rest]`` for
    ``response_shape = (S, B, N)``."""
    return x.reshape(tuple(int(n) for n in response_shape) + tuple(jnp.shape(x)[1:]))


def flatten_agents(x: jax.Array) -> jax.Array:
    """``[B, N, *rest]`` -> ``[B*N, *rest]``: one row per (row, agent), flat row ``r = b*N + i``
    (bootstrap contexts and values; the rows of :func:`flatten_agent_sequences`)."""
    shape = jnp.shape(x)
    return x.reshape((shape[0] * shape[1],) + tuple(shape[2:]))


def unflatten_agents(x: jax.Array, num_agents: int) -> jax.Array:
    """Inverse of :func:`flatten_agents`: ``[B*N, *rest]`` -> ``[B, N, *rest]``."""
    return x.reshape((-1, int(num_agents)) + tuple(jnp.shape(x)[1:]))


def agent_major(x: jax.Array) -> jax.Array:
    """``[S, B, N, *rest]`` -> ``[N, S*B, *rest]``: each agent's responses as rows ``s*B + b``
    (the update's scan over agents, the per-agent log-prob pass)."""
    shape = jnp.shape(x)
    x = _moveaxis(x, AGENT_AXIS, 0)                                     # [N, S, B, *rest]
    return x.reshape((shape[2], shape[0] * shape[1]) + tuple(shape[3:]))


def from_agent_major(x: jax.Array, step_batch: Sequence[int]) -> jax.Array:
    """Inverse of :func:`agent_major`: ``[N, S*B, *rest]`` -> ``[S, B, N, *rest]`` for
    ``step_batch = (S, B)``."""
    shape = jnp.shape(x)
    x = x.reshape((shape[0],) + tuple(int(n) for n in step_batch) + tuple(shape[2:]))   # [N, S, B, *rest]
    return _moveaxis(x, 0, AGENT_AXIS)


# ----------------------------------------------------------------------------------------------
# Decision-point masks.


def token_decision_mask(act_mask: jax.Array, step_mask: jax.Array) -> jax.Array:
    """Token-level decision points: ``act_mask & step_mask``.

    Args:
      act_mask: ``[S, B, N, K]`` bool, ``act_mask[..., k] = k < K_{s,b,i}``.
      step_mask: ``[S, B]`` bool, step played.

    Returns:
      ``[S, B, N, K]`` bool.
    """
    return jnp.logical_and(act_mask.astype(bool), step_mask.astype(bool)[:, :, None, None])


def action_decision_mask(act_mask: jax.Array, step_mask: jax.Array) -> jax.Array:
    """Action-level decision points: step played and the agent produced >= 1 token.

    Args:
      act_mask: ``[S, B, N, K]`` bool.
      step_mask: ``[S, B]`` bool.

    Returns:
      ``[S, B, N]`` bool.
    """
    return jnp.logical_and(jnp.any(act_mask.astype(bool), axis=-1),
                           step_mask.astype(bool)[:, :, None])


def lengths_to_mask(lengths: jax.Array, max_len: int) -> jax.Array:
    """``[...]`` int lengths -> ``[..., max_len]`` bool, ``mask[..., k] = k < length``."""
    return jnp.arange(max_len, dtype=jnp.int32) < jnp.asarray(lengths)[..., None]


def last_played_step(step_mask: jax.Array) -> jax.Array:
    """Index of the last played step of each row: the one definition of the episode's final
    step (rewards, backups, evaluation and metrics all read it through here).

    Args:
      step_mask: ``[S, B]`` bool (NumPy or JAX).

    Returns:
      ``[B]`` int32, ``-1`` for a row with no played step.
    """
    s = jnp.arange(step_mask.shape[0], dtype=jnp.int32)[:, None]
    return jnp.max(jnp.where(jnp.asarray(step_mask, bool), s, -1), axis=0)


def last_played_onehot(step_mask: jax.Array) -> jax.Array:
    """``[S, B]`` bool, True only at each row's last played step (:func:`last_played_step`);
    a row with no played step is all False. Compute it once and read several arrays at it with
    :func:`at_step`."""
    s_star = last_played_step(step_mask)                                  # [B]
    return jnp.arange(jnp.shape(step_mask)[0], dtype=jnp.int32)[:, None] == s_star[None, :]


def at_step(x: jax.Array, onehot: jax.Array) -> jax.Array:
    """``x[s_b, b]`` for a ``[S, B, *rest]`` array at the step marked by ``onehot [S, B]`` bool
    (at most one True per row; zeros/False where none is).

    Returns:
      ``[B, *rest]``, dtype of ``x``.
    """
    x = jnp.asarray(x)
    onehot = onehot.reshape(onehot.shape + (1,) * (x.ndim - 2))
    if x.dtype == jnp.bool_:
        return jnp.any(jnp.logical_and(onehot, x), axis=0)
    return jnp.sum(jnp.where(onehot, x, jnp.zeros((), x.dtype)), axis=0)


def at_last_played_step(x: jax.Array, step_mask: jax.Array) -> jax.Array:
    """``x[s*_b, b]`` for a ``[S, B, *rest]`` array, s* = last played step; zeros/False if none.

    Returns:
      ``[B, *rest]``, dtype of ``x``.
    """
    return at_step(x, last_played_onehot(step_mask))
