"""Bellman backups (GAE) along the execution order token -> agent -> step (reference §6, §10).

All backups use the unified formulation of §6(c). Per row, the decision points are flattened in
execution order (``layout.flatten_decisions``) to one axis ``p = 0 .. P-1`` with validity
``u_p``, reward ``r_p``, value ``V_p`` and link factor ``c_p``; a virtual point ``P`` with
``V_P = V_end`` and ``A_P = 0`` is appended. With ``s(p)`` the next valid point after ``p``::

    delta_p = r_p + gamma * c_p * V_{s(p)} - V_p
    A_p     = delta_p + gamma * lam * c_p * A_{s(p)}      (A_p = 0 where u_p = 0)
    R_p     = A_p + V_p                                    (R_p = 0 where u_p = 0)

This one masked reverse linear recurrence reproduces §6(a) (action level, one point per agent)
and §6(b) (token level): inside a response the next point is the next token; an agent's last
token links to the first token of the next agent that produced tokens (factor 1); the last
such agent of step s links to agent 0 of the next step with tokens (factor ``e_s``); agents and
steps without tokens are skipped (no NaN, no crash).

Link factors and bootstrap (``reference_semantics=False``, the ``marft_jax`` semantics):

* ``c_p = 0`` iff ``p`` is the last valid point of a *terminal* played step, else 1. (If a
  terminal step has no valid point at all, the cut moves to the last valid point before it.)
* ``step_mask`` must be a prefix per row (steps 0 .. s* played).
* ``V_end = V_boot`` iff the row's last played step s* is ``truncated`` and not ``terminal``;
  otherwise ``V_end = 0`` (terminal rows never bootstrap; a row that is neither terminal nor
  truncated at s* is treated as ended without a bootstrap value). ``A_end = 0`` always: the
  trace is cut at the truncation.
* Inside a step the chaining factor is 1.

``reference_semantics=True`` reproduces G1's buffers (``marft/buffers/*_level_buffer.py``)
given G1-style masks ``mask_s = 1 - terminal_{s-1}`` (``mask_0 = 1``, G1 never writes it):

* quirk #10: the agent ``i -> i+1`` link inside step s is multiplied by the *current* step's
  mask, so for ``s >= 1`` with ``terminal[s-1]`` (the first step of an auto-reset episode inside
  a row) ``c_p = 0`` at the last valid point of every agent ``i < N-1``. Whole-episode rows
  (terminal only at s*) are unaffected.
* bootstrap: ``V_end = V_boot * (1 - terminal[s*])``; G1 has no truncated flag (it bootstraps
  every unfinished segment end), so ``truncated`` is ignored.
G1's crash on empty token-level responses and its raw-observation bootstrap value (quirks #12,
#6) are not reproduced: empty responses are skipped, and ``v_boot`` is whatever the caller
passes.

Implementations (``impl``): ``"scan"`` = one ``lax.scan(reverse=True)`` over p carrying the
next valid value and advantage, the batch rows as the vector axis; ``"associative"`` = two
``lax.associative_scan(reverse=True)`` over the first-order recurrences ``x_p = a_p + b_p x_{p+1}``
(next valid value, then advantage). Both run in float32 and give the same numbers up to float
rounding. The batch axis carries no dependency, so it may be sharded (``NamedSharding`` with
``P(None, "data")`` on ``[S, B, ...]`` inputs); outputs keep that sharding.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from marft_jax.rl import layout

IMPLS = ("scan", "associative")


class Backup(NamedTuple):
    """Advantages and returns in the input layout, float32, zero on invalid decision points."""

    advantages: jax.Array
    returns: jax.Array


# ----------------------------------------------------------------------------------------------
# Core: rows of flattened decision points.


def _linear_combine(right, left):
    """Reverse-mode combine for ``x_p = a_p + b_p * x_{p+1}``.

    ``right`` is the already-combined part to the right (closer to the end), ``left`` the new
    element(s) on the left: the composition is ``x -> a_l + b_l * (a_r + b_r * x)``.
    """
    a_r, b_r = right
    a_l, b_l = left
    return a_l + b_l * a_r, b_l * b_r


def gae_rows(
    reward: jax.Array,
    value: jax.Array,
    valid: jax.Array,
    link: jax.Array,
    value_end: jax.Array,
    *,
    gamma: float | jax.Array,
    lam: float | jax.Array,
    impl: str = "scan",
    unroll: int = 1,
) -> jax.Array:
    """The unified masked reverse GAE recurrence over rows of decision points (§6c).

    Args:
      reward: ``[R, P]`` float, rewards placed on valid points.
      value: ``[R, P]`` float, V_p.
      valid: ``[R, P]`` bool, u_p.
      link: ``[R, P]`` float, c_p (0 cuts both bootstrap and trace after p).
      value_end: ``[R]`` float, V of the virtual point P (bootstrap value or 0).
      gamma, lam: discount and GAE lambda.
      impl: ``"scan"`` or ``"associative"``.
      unroll: ``lax.scan`` unroll factor (``impl="scan"`` only).

    Returns:
      ``[R, P]`` float32 advantages, 0 where ``valid`` is False.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    f32 = jnp.float32
    r = reward.astype(f32)
    v = value.astype(f32)
    u = valid.astype(bool)
    c = link.astype(f32)
    v_end = value_end.astype(f32)
    gamma = jnp.asarray(gamma, f32)
    gl = gamma * jnp.asarray(lam, f32)

    if impl == "scan":
        def step(carry, x):
            next_v, next_a = carry
            r_p, v_p, u_p, c_p = x
            delta = r_p + gamma * c_p * next_v - v_p
            a_p = jnp.where(u_p, delta + gl * c_p * next_a, 0.0)
            return (jnp.where(u_p, v_p, next_v), jnp.where(u_p, a_p, next_a)), a_p

        xs = (r.T, v.T, u.T, c.T)                             # time-major view, scan-local
        init = (v_end, jnp.zeros_like(v_end))
        _, adv = lax.scan(step, init, xs, reverse=True, unroll=unroll)
        return adv.T

    # Next valid value after p: N_q = u_q V_q + (1 - u_q) N_{q+1}, N_P = V_end; V_{s(p)} = N_{p+1}.
    uf = u.astype(f32)
    a_nv, b_nv = lax.associative_scan(
        _linear_combine, (jnp.where(u, v, 0.0), 1.0 - uf), reverse=True, axis=1)
    n_q = a_nv + b_nv * v_end[:, None]
    v_next = jnp.concatenate([n_q[:, 1:], v_end[:, None]], axis=1)
    delta = r + gamma * c * v_next - v
    # A_p = u_p delta_p + (u_p gamma lam c_p + 1 - u_p) A_{p+1}, A_P = 0.
    a_adv, _ = lax.associative_scan(
        _linear_combine, (jnp.where(u, delta, 0.0), jnp.where(u, gl * c, 1.0)),
        reverse=True, axis=1)
    return jnp.where(u, a_adv, 0.0)


def _last_valid(valid: jax.Array) -> jax.Array:
    """``[..., K]`` bool -> ``[..., K]`` bool: True at the last True entry along the last axis."""
    k = jnp.arange(valid.shape[-1], dtype=jnp.int32)
    last = jnp.max(jnp.where(valid, k, -1), axis=-1, keepdims=True)
    return jnp.logical_and(k == last, valid)


def _step_cuts(has_valid: jax.Array, terminal: jax.Array) -> jax.Array:
    """Whether the link leaving step s crosses a terminal step.

    The last valid point of step s links to the first valid point of the next step s' > s that
    has one (or to the end of the row); the link is cut iff any of steps s .. s'-1 is terminal
    (whole-episode rows: only a terminal s itself; the extra case is a terminal step without
    any valid point, after which nothing may chain across).

    Args:
      has_valid: ``[S, ...]`` bool, the step has a valid point (per row, or per row and agent).
      terminal: ``[S, ...]`` bool (broadcastable to ``has_valid``).

    Returns:
      ``[S, ...]`` bool. S is static and small: a Python loop over steps.
    """
    terminal = jnp.broadcast_to(terminal, has_valid.shape)
    cuts = [terminal[-1]]
    for s in range(has_valid.shape[0] - 2, -1, -1):
        cuts.append(jnp.logical_or(
            terminal[s], jnp.logical_and(jnp.logical_not(has_valid[s + 1]), cuts[-1])))
    return jnp.stack(cuts[::-1], axis=0)


def _marft_links(valid: jax.Array, terminal: jax.Array, reference_semantics: bool) -> jax.Array:
    """Link factors c_p of the chained backup, in the canonical layout.

    Args:
      valid: ``[S, B, N, K]`` bool (action level: K = 1).
      terminal: ``[S, B]`` bool, already masked by ``step_mask``.

    Returns:
      ``[S, B, N, K]`` float32: 0 at the last valid point of each terminal step (and of a step
      whose link would cross a terminal step without valid points); with
      ``reference_semantics`` also 0 at the last valid point of each agent ``i < N-1`` of a step
      ``s >= 1`` following a terminal step (G1's intra-step mask, quirk #10); 1 elsewhere.
    """
    agent_last = _last_valid(valid)                                     # [S, B, N, K]
    agent_any = jnp.any(valid, axis=-1)                                 # [S, B, N]
    step_last_agent = _last_valid(agent_any)                            # [S, B, N]
    cut = jnp.logical_and(agent_last, step_last_agent[..., None])
    step_cut = _step_cuts(jnp.any(agent_any, axis=-1), terminal)        # [S, B]
    cut = jnp.logical_and(cut, step_cut[:, :, None, None])
    if reference_semantics:
        prev_terminal = jnp.concatenate(
            [jnp.zeros_like(terminal[:1]), terminal[:-1]], axis=0)      # G1: 1 - masks[s]
        not_last_agent = jnp.arange(valid.shape[2]) < valid.shape[2] - 1
        quirk = jnp.logical_and(prev_terminal[:, :, None], not_last_agent[None, None, :])
        cut = jnp.logical_or(cut, jnp.logical_and(agent_last, quirk[..., None]))
    return jnp.where(cut, 0.0, 1.0).astype(jnp.float32)


def _check_inputs(reward, value, dp_mask, step_mask, terminal, truncated, level):
    axes = layout.TOKEN_AXES if level == "token" else layout.ACTION_AXES
    dims = layout.assert_layout(value, "value", axes, dtype=jnp.floating)
    layout.assert_layout(reward, "reward", axes, sizes=dims, dtype=jnp.floating)
    layout.assert_layout(dp_mask, "dp_mask", axes, sizes=dims, dtype=bool)
    for name, x in (("step_mask", step_mask), ("terminal", terminal), ("truncated", truncated)):
        layout.assert_layout(x, name, layout.STEP_AXES, sizes=dims, dtype=bool)
    return dims


def _prepare(reward, value, dp_mask, step_mask, terminal):
    """Token-shaped float32 copies (action level gets a K = 1 axis), masked validity/terminal."""
    action_level = value.ndim == 3
    expand = (lambda x: x[..., None]) if action_level else (lambda x: x)
    step_mask = step_mask.astype(bool)
    terminal = jnp.logical_and(terminal.astype(bool), step_mask)
    valid = jnp.logical_and(expand(dp_mask.astype(bool)), step_mask[:, :, None, None])
    r = jnp.where(valid, expand(reward.astype(jnp.float32)), 0.0)
    v = jnp.where(valid, expand(value.astype(jnp.float32)), 0.0)   # pads may hold garbage/NaN
    return r, v, valid, step_mask, terminal


def _row_end(step_mask, terminal, truncated, reference_semantics):
    """Per row: whether V_boot is used at the virtual end point. ``[B]`` bool."""
    term_last = layout.at_last_played_step(terminal, step_mask)
    if reference_semantics:
        return jnp.logical_and(jnp.any(step_mask, axis=0), jnp.logical_not(term_last))
    trunc_last = layout.at_last_played_step(truncated, step_mask)
    return jnp.logical_and(trunc_last, jnp.logical_not(term_last))


# ----------------------------------------------------------------------------------------------
# MARFT backups (chained: token -> agent -> step).


def marft_gae(
    reward: jax.Array,
    value: jax.Array,
    dp_mask: jax.Array,
    step_mask: jax.Array,
    terminal: jax.Array,
    truncated: jax.Array,
    v_boot: jax.Array,
    *,
    gamma: float | jax.Array,
    lam: float | jax.Array,
    impl: str = "scan",
    reference_semantics: bool = False,
    unroll: int = 1,
) -> Backup:
    """Chained MARFT backup at action or token level (level read from the rank of ``value``).

    Args:
      reward: ``[S, B, N]`` (action) or ``[S, B, N, K]`` (token) float, placed rewards
        (``rewards.place_reward``); entries off valid points are ignored.
      value: same shape, float, critic value per decision point.
      dp_mask: same shape, bool, valid decision points.
      step_mask: ``[S, B]`` bool, step played.
      terminal: ``[S, B]`` bool, episode ended at s by termination (no bootstrap).
      truncated: ``[S, B]`` bool, episode ended at s by a step cap (bootstrap from ``v_boot``).
      v_boot: ``[B]`` float, critic value at agent 0's context of step s*+1.
      gamma, lam: discount and GAE lambda (action default 0.99 / 0.95, token 1 / 1).
      impl: ``"scan"`` (default) or ``"associative"``.
      reference_semantics: reproduce G1's masks (quirk #10) and bootstrap; see module doc.
      unroll: ``lax.scan`` unroll (``impl="scan"``).

    Returns:
      :class:`Backup` ``(advantages, returns)``, float32, shaped like ``value``, zero on invalid
      points.
    """
    level = layout.level_of(value)
    dims = _check_inputs(reward, value, dp_mask, step_mask, terminal, truncated, level)
    layout.assert_layout(v_boot, "v_boot", (layout.BATCH,), sizes=dims)
    r, v, valid, step_mask, terminal = _prepare(reward, value, dp_mask, step_mask, terminal)
    link = _marft_links(valid, terminal, reference_semantics)
    use_boot = _row_end(step_mask, terminal, truncated.astype(bool), reference_semantics)
    v_end = jnp.where(use_boot, v_boot.astype(jnp.float32), 0.0)

    flat = lambda x: layout.flatten_decisions(x, "token")              # [B, P]
    u = flat(valid)
    v_flat = flat(v)
    adv = gae_rows(flat(r), v_flat, u, flat(link), v_end,
                   gamma=gamma, lam=lam, impl=impl, unroll=unroll)
    ret = jnp.where(u, adv + v_flat, 0.0)
    unflat = lambda x: layout.unflatten_decisions(x, valid.shape[:1] + valid.shape[2:]).reshape(value.shape)
    return Backup(unflat(adv), unflat(ret))


def action_level_gae(
    reward: jax.Array,
    value: jax.Array,
    dp_mask: jax.Array,
    step_mask: jax.Array,
    terminal: jax.Array,
    truncated: jax.Array,
    v_boot: jax.Array,
    *,
    gamma: float | jax.Array = 0.99,
    lam: float | jax.Array = 0.95,
    impl: str = "scan",
    reference_semantics: bool = False,
) -> Backup:
    """MARFT-A backup (§6a). ``reward``, ``value``, ``dp_mask``: ``[S, B, N]``; see :func:`marft_gae`."""
    if layout.level_of(value) != "action":
        raise AssertionError(f"action_level_gae: value must be [S, B, N], got {value.shape}")
    return marft_gae(reward, value, dp_mask, step_mask, terminal, truncated, v_boot,
                     gamma=gamma, lam=lam, impl=impl, reference_semantics=reference_semantics)


def token_level_gae(
    reward: jax.Array,
    value: jax.Array,
    dp_mask: jax.Array,
    step_mask: jax.Array,
    terminal: jax.Array,
    truncated: jax.Array,
    v_boot: jax.Array,
    *,
    gamma: float | jax.Array = 1.0,
    lam: float | jax.Array = 1.0,
    impl: str = "scan",
    reference_semantics: bool = False,
) -> Backup:
    """MARFT-T backup (§6b). ``reward``, ``value``, ``dp_mask``: ``[S, B, N, K]``; see :func:`marft_gae`."""
    if layout.level_of(value) != "token":
        raise AssertionError(f"token_level_gae: value must be [S, B, N, K], got {value.shape}")
    return marft_gae(reward, value, dp_mask, step_mask, terminal, truncated, v_boot,
                     gamma=gamma, lam=lam, impl=impl, reference_semantics=reference_semantics)


# ----------------------------------------------------------------------------------------------
# Independent PPO (§10): no chaining, agent i at step s links to agent i at step s+1.


def independent_gae(
    reward: jax.Array,
    value: jax.Array,
    dp_mask: jax.Array,
    step_mask: jax.Array,
    terminal: jax.Array,
    truncated: jax.Array,
    v_boot: jax.Array,
    *,
    gamma: float | jax.Array,
    lam: float | jax.Array,
    impl: str = "scan",
    unroll: int = 1,
) -> Backup:
    """Independent-PPO backup: each agent's own sequence of decision points over steps.

    Agent i's last valid point of step s links to agent i's first valid point of a later step
    (factor ``e_s = 1 - terminal_s``), never to another agent. Terminal/truncated semantics as
    in :func:`marft_gae` (``reference_semantics=False``), per agent.

    Args:
      reward, value, dp_mask: ``[S, B, N]`` (action) or ``[S, B, N, K]`` (token); per-agent
        rewards placed on each agent's own points (``place_reward(..., reward_to="all")``).
      step_mask, terminal, truncated: ``[S, B]`` bool (the episode is shared by all agents).
      v_boot: ``[B, N]`` float, each agent's bootstrap value at its own next-step context.

    Returns:
      :class:`Backup` in the input layout, float32, zero on invalid points.
    """
    level = layout.level_of(value)
    dims = _check_inputs(reward, value, dp_mask, step_mask, terminal, truncated, level)
    layout.assert_layout(v_boot, "v_boot", (layout.BATCH, layout.AGENT), sizes=dims)
    r, v, valid, step_mask, terminal = _prepare(reward, value, dp_mask, step_mask, terminal)
    # Each agent's own sequence: cut after its last valid point of a terminal step.
    step_cut = _step_cuts(jnp.any(valid, axis=-1), terminal[:, :, None])          # [S, B, N]
    link = jnp.where(jnp.logical_and(_last_valid(valid), step_cut[..., None]), 0.0, 1.0)
    use_boot = _row_end(step_mask, terminal, truncated.astype(bool), False)          # [B]
    v_end = jnp.where(use_boot[:, None], v_boot.astype(jnp.float32), 0.0).reshape(-1)

    flat = lambda x: layout.flatten_agent_sequences(x, "token")        # [B*N, S*K]
    u = flat(valid)
    v_flat = flat(v)
    adv = gae_rows(flat(r), v_flat, u, flat(link), v_end,
                   gamma=gamma, lam=lam, impl=impl, unroll=unroll)
    ret = jnp.where(u, adv + v_flat, 0.0)
    unflat = lambda x: layout.unflatten_agent_sequences(
        x, valid.shape[:1] + valid.shape[2:]).reshape(value.shape)
    return Backup(unflat(adv), unflat(ret))
