"""Team-reward transform and placement on decision points (docs/algorithm.md#rewards).

Pipeline: ``score [S, B]`` -> :func:`final_step_reward` (the score of the step at which the
episode ends, ``[B]``) -> :func:`transform_reward` -> :func:`place_reward` (``[S, B, N]`` or
``[S, B, N, K]``, nonzero only on valid decision points) -> backups. For independent PPO,
per-agent scores ``[B, N]`` go through :func:`mix_independent_rewards` first and are placed with
``reward_to="all"``.

All functions are pure, jittable, float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from marft_jax.rl import backups, layout
from marft_jax.rl.topology import LinkTable

REWARD_TO = ("last", "all")


def transform_reward(
    reward: jax.Array,
    *,
    bias: float = 0.0,
    scale: float = 1.0,
    clip: float | None = None,
) -> jax.Array:
    """``r' = clip((r + bias) * scale, -clip, +clip)``; ``clip=None`` means no clipping.

    Defaults (bias 0, scale 1, no clip) are G1's; G2 uses bias -0.5, scale 10, clip 20.

    Args:
      reward: any shape, float.

    Returns:
      Same shape, float32.
    """
    r = (jnp.asarray(reward, jnp.float32) + bias) * scale
    if clip is not None:
        r = jnp.clip(r, -clip, clip)
    return r


def final_step_reward(score: jax.Array, step_mask: jax.Array) -> jax.Array:
    """The team reward of each row: the score of its last played step (0 if none played).

    Args:
      score: ``[S, B]`` float, verifier score per step.
      step_mask: ``[S, B]`` bool.

    Returns:
      ``[B]`` float32.
    """
    dims = layout.assert_layout(score, "score", layout.STEP_AXES)
    layout.assert_layout(step_mask, "step_mask", layout.STEP_AXES, sizes=dims)
    return layout.at_last_played_step(jnp.asarray(score, jnp.float32), step_mask)


def place_reward(
    reward: jax.Array,
    dp_mask: jax.Array,
    step_mask: jax.Array,
    *,
    reward_to: str = "last",
    links: LinkTable | None = None,
) -> jax.Array:
    """Places each row's (transformed) reward on decision points of its final step.

    The final step of a row is its last played step s*. The level (action or token) is read
    from the rank of ``dp_mask``.

    ``reward_to="last"`` (default, G1): the team reward goes to the last agent's last valid
    decision point of step s* (action: ``(s*, N-1)``; token: that agent's last valid token).
    If that agent produced no tokens, it moves to the last valid decision point at or before
    that slot in execution order (possibly an earlier agent, or an earlier step if step s* has
    no valid point at all). A row without any valid point gets no reward.

    ``reward_to="all"`` (G2): every agent gets a copy at its own last valid decision point of
    step s*; agents with no tokens at s* get nothing (the copy is dropped).

    ``links`` (a team graph's link table, static; None or ``kind="chain"``: the placements
    above). With ``kind="table"`` and ``reward_to="last"``, every response with a valid point
    whose link leads to the row's end (its successor, resolved through the skip targets past
    responses without valid points, is the virtual end, as in ``backups.marft_gae``) gets a
    copy at its last valid point: with ``team.layer_links=layer``, every agent of the last
    layer of step s* that produced tokens (``Topology.reward_receivers``); if none did, every
    responding agent of the layer before, and so on. On the chain table that rule is exactly
    the ``"last"`` placement above.

    Args:
      reward: ``[B]`` float, the team reward per row, or ``[B, N]`` per-agent rewards
        (independent PPO; requires ``reward_to="all"``).
      dp_mask: ``[S, B, N]`` (action level) or ``[S, B, N, K]`` (token level) bool, valid
        decision points (see ``layout.action_decision_mask`` / ``token_decision_mask``).
      step_mask: ``[S, B]`` bool, step played.
      reward_to: ``"last"`` or ``"all"``.

    Returns:
      float32 array shaped like ``dp_mask``, zero except at the placed points.
    """
    if reward_to not in REWARD_TO:
        raise ValueError(f"reward_to must be one of {REWARD_TO}, got {reward_to!r}")
    level = layout.level_of(dp_mask)
    axes = layout.TOKEN_AXES if level == "token" else layout.ACTION_AXES
    dims = layout.assert_layout(dp_mask, "dp_mask", axes, dtype=bool)
    layout.assert_layout(step_mask, "step_mask", layout.STEP_AXES, sizes=dims)
    reward = jnp.asarray(reward, jnp.float32)
    per_agent = reward.ndim == 2
    if per_agent:
        layout.assert_layout(reward, "reward", (layout.BATCH, layout.AGENT), sizes=dims)
        if reward_to != "all":
            raise ValueError("per-agent rewards [B, N] need reward_to='all'")
    else:
        layout.assert_layout(reward, "reward", (layout.BATCH,), sizes=dims)

    valid = jnp.logical_and(dp_mask, step_mask.astype(bool)[(...,) + (None,) * (dp_mask.ndim - 2)])
    num_steps = dp_mask.shape[0]

    if reward_to == "last" and links is not None and links.kind == "table":
        return _place_at_link_ends(reward, valid, links, level)
    if reward_to == "last":
        s_star = layout.last_played_step(step_mask)                    # [B]
        flat = layout.flatten_decisions(valid, level)                  # [B, P]
        per_step = flat.shape[1] // num_steps
        idx = jnp.arange(flat.shape[1], dtype=jnp.int32)[None, :]
        limit = (s_star + 1) * per_step                                # first index after s*
        cand = jnp.logical_and(flat, idx < limit[:, None])
        last = jnp.max(jnp.where(cand, idx, -1), axis=1)               # [B], -1 if none
        hit = jnp.logical_and(idx == last[:, None], last[:, None] >= 0)
        placed = jnp.where(hit, reward[:, None], 0.0)
        return layout.unflatten_decisions(placed, (num_steps,) + tuple(dp_mask.shape[2:]))

    # reward_to == "all": each agent's own last valid point of step s*.
    at_final = layout.last_played_onehot(step_mask)                    # [S, B]
    r = reward if per_agent else jnp.broadcast_to(reward[:, None], valid.shape[1:3])   # [B, N]
    if level == "action":
        hit = jnp.logical_and(valid, at_final[:, :, None])
        return jnp.where(hit, r[None], 0.0)
    k = jnp.arange(valid.shape[-1], dtype=jnp.int32)
    last_k = jnp.max(jnp.where(valid, k, -1), axis=-1)                 # [S, B, N]
    hit = jnp.logical_and(k == last_k[..., None], last_k[..., None] >= 0)
    hit = jnp.logical_and(hit, at_final[:, :, None, None])
    return jnp.where(hit, r[None, :, :, None], 0.0)


def _place_at_link_ends(reward: jax.Array, valid: jax.Array, links: LinkTable, level: str) -> jax.Array:
    """``reward [B]`` on the last valid point of every response whose link resolves to the end
    (:func:`place_reward`); ``valid`` ``[S, B, N(, K)]`` bool (dp_mask & step_mask)."""
    S, N = valid.shape[0], valid.shape[2]
    if (links.num_steps, links.num_agents) != (S, N):
        raise ValueError(f"the link table is for {links.num_steps} step(s) x {links.num_agents} agent(s), the "
                         f"rewards' decision points are {S} x {N}")
    linked = backups.link_index(links)
    has = valid if level == "action" else jnp.any(valid, axis=-1)      # [S, B, N]
    nxt, has_c = backups.link_targets(has, linked)
    ones = jnp.ones(has.shape[1], jnp.float32)
    # 1 at a link target from which the skips reach the end without meeting a valid point.
    ends = backups.chunk_recurrence(jnp.zeros(has_c.shape, jnp.float32), jnp.where(has_c, 0.0, 1.0), nxt,
                                    ones, linked.order)
    hit = jnp.logical_and(has, layout.from_time_major_decisions(ends[jnp.asarray(linked.succ)] > 0.5, (S, N)))
    if level == "action":
        return jnp.where(hit, reward[None, :, None], 0.0)
    k = jnp.arange(valid.shape[-1], dtype=jnp.int32)
    last_k = jnp.max(jnp.where(valid, k, -1), axis=-1)                 # [S, B, N]
    at = jnp.logical_and(k == last_k[..., None], hit[..., None])
    return jnp.where(at, reward[None, :, None, None], 0.0)


def mix_independent_rewards(reward: jax.Array, weight: float = 0.5) -> jax.Array:
    """Independent-PPO shaped reward ``r_i <- w * r_i + (1 - w) * mean_j r_j`` (G2: w = 0.5).

    Args:
      reward: ``[..., N]`` float, per-agent rewards on the last (agent) axis, e.g. ``[B, N]``.
      weight: w, the weight of the agent's own reward.

    Returns:
      ``[..., N]`` float32.
    """
    r = jnp.asarray(reward, jnp.float32)
    return weight * r + (1.0 - weight) * jnp.mean(r, axis=-1, keepdims=True)
