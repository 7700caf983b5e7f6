"""PPO losses for MARFT as exact (sum, count) reductions (docs/algorithm.md#losses).

Every loss returns a :class:`LossSums`: the *sum* of its masked per-element terms, the *count*
of valid elements (the denominator), and metric sums over the same elements. Accumulate
micro-batches with :func:`add_sums` (or ``jax.tree.map(jnp.add, ...)``) and divide once with
:func:`finalize`; this equals the full-minibatch masked mean exactly (up to float summation
order), however unevenly the micro-batches are split. Denominators are ``max(count, 1)``: an
empty mask gives 0, never NaN.

Shapes use ``...`` for any leading axes, e.g. ``[step, batch, agent]`` for all agents or
``[step, batch]`` for one agent's slice; token-level arrays add a trailing ``token`` axis
(``[..., K]``). All losses compute in float32. Advantage normalization statistics are
minibatch-wide: compute them once (:func:`masked_mean_std`) and pass them to every micro-batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

LOGP_NORMS = ("sum", "token", "word")
ADV_NORM_MODES = ("minibatch", "batch", "none")
VALUE_LOSSES = ("huber", "mse")


class LossSums(NamedTuple):
    """A loss as exact sums. All leaves are float32 scalars.

    Attributes:
      loss: sum over valid elements of the per-element loss (coefficients applied).
      count: number of valid elements.
      metrics: ``{name: sum over the same valid elements}``; divide by ``count``.
    """

    loss: jax.Array
    count: jax.Array
    metrics: dict[str, jax.Array]


def add_sums(a: LossSums, b: LossSums) -> LossSums:
    """Adds two :class:`LossSums` with the same metric names (micro-batch accumulation)."""
    return jax.tree.map(jnp.add, a, b)


def finalize(sums: LossSums) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(loss / max(count, 1), {name: metric / max(count, 1)})``."""
    denom = jnp.maximum(sums.count, 1.0)
    return sums.loss / denom, {k: v / denom for k, v in sums.metrics.items()}


def masked_sum_count(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(sum of x where mask, number of True in mask)``, float32 scalars; masked NaNs are ignored."""
    chex.assert_equal_shape([x, mask])
    m = mask.astype(bool)
    return (jnp.sum(jnp.where(m, x.astype(jnp.float32), 0.0)),
            jnp.sum(m, dtype=jnp.float32))


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked mean with denominator ``max(count, 1)``; float32 scalar."""
    total, count = masked_sum_count(x, mask)
    return total / jnp.maximum(count, 1.0)


def masked_mean_std(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Masked mean and masked *population* standard deviation; 0 for an empty mask."""
    mean = masked_mean(x, mask)
    var = masked_mean(jnp.square(x.astype(jnp.float32) - mean), mask)
    return mean, jnp.sqrt(var)


def normalize_advantages(
    adv: jax.Array,
    mask: jax.Array,
    *,
    mode: str = "minibatch",
    stats: tuple[jax.Array, jax.Array] | None = None,
    eps: float = 1e-8,
) -> jax.Array:
    """``u * (A - mu) / (sigma + eps)`` over valid decision points
    (docs/algorithm.md#advantage-normalization).

    ``mode="minibatch"`` (default) and ``"batch"`` differ only in *which* points the statistics
    come from: the caller passes the minibatch (or the whole batch) here, or passes
    ``stats = masked_mean_std(adv_all, mask_all)`` computed over that set when ``adv`` is a
    micro-batch slice. ``mode="none"`` returns ``u * A``.

    Args:
      adv: ``[...]`` float advantages (action level ``[S, B, N]``, token level ``[S, B, N, K]``).
      mask: same shape, bool, valid decision points.
      stats: optional ``(mu, sigma)``; computed from ``adv``/``mask`` if ``None``.

    Returns:
      Same shape, float32, zero where ``mask`` is False.
    """
    if mode not in ADV_NORM_MODES:
        raise ValueError(f"adv_norm must be one of {ADV_NORM_MODES}, got {mode!r}")
    chex.assert_equal_shape([adv, mask])
    adv = adv.astype(jnp.float32)
    m = mask.astype(bool)
    if mode == "none":
        return jnp.where(m, adv, 0.0)
    mean, std = masked_mean_std(adv, m) if stats is None else stats
    return jnp.where(m, (adv - mean) / (std + eps), 0.0)


# ----------------------------------------------------------------------------------------------
# Policy losses.


def action_logprob(
    logp: jax.Array,
    act_mask: jax.Array,
    *,
    norm: str = "sum",
    word_count: jax.Array | None = None,
) -> jax.Array:
    """Normalized action log-prob ``l = sum_k log pi(a_k)`` (``sum``), ``l / K`` (``token``) or
    ``l / max(W, 1)`` (``word``).

    Args:
      logp: ``[..., K]`` float, per-token log-probs.
      act_mask: ``[..., K]`` bool, valid action tokens.
      word_count: ``[...]`` int, whitespace-separated words of the decoded response (``word``).

    Returns:
      ``[...]`` float32 (0 for an empty response).
    """
    if norm not in LOGP_NORMS:
        raise ValueError(f"logp normalization must be one of {LOGP_NORMS}, got {norm!r}")
    chex.assert_equal_shape([logp, act_mask])
    m = act_mask.astype(bool)
    total = jnp.sum(jnp.where(m, logp.astype(jnp.float32), 0.0), axis=-1)
    if norm == "sum":
        return total
    if norm == "token":
        return total / jnp.maximum(jnp.sum(m, axis=-1, dtype=jnp.float32), 1.0)
    if word_count is None:
        raise ValueError("norm='word' needs word_count")
    chex.assert_shape(word_count, logp.shape[:-1])
    return total / jnp.maximum(word_count.astype(jnp.float32), 1.0)


def clipped_surrogate(log_ratio: jax.Array, adv: jax.Array, clip_eps: float) -> jax.Array:
    """Per-element PPO loss ``-min(rho A, clip(rho, 1-eps, 1+eps) A)``, ``rho = exp(log_ratio)``."""
    ratio = jnp.exp(log_ratio)
    return -jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)


def approx_kl_k3(log_ratio: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """k3 estimator ``(rho - 1) - log rho`` as ``(sum, count)`` over ``mask``."""
    m = mask.astype(bool)
    lr = jnp.where(m, log_ratio.astype(jnp.float32), 0.0)
    return masked_sum_count(jnp.expm1(lr) - lr, m)


def clip_fraction(log_ratio: jax.Array, mask: jax.Array, clip_eps: float) -> tuple[jax.Array, jax.Array]:
    """Number of valid elements with ``|rho - 1| > eps``, as ``(sum, count)``."""
    m = mask.astype(bool)
    ratio = jnp.exp(jnp.where(m, log_ratio.astype(jnp.float32), 0.0))
    return masked_sum_count((jnp.abs(ratio - 1.0) > clip_eps).astype(jnp.float32), m)


def entropy_bonus(
    entropy: jax.Array, act_mask: jax.Array, *, level: str = "token"
) -> tuple[jax.Array, jax.Array]:
    """Entropy as ``(sum, count)``.

    Args:
      entropy: ``[..., K]`` float, per-token full-vocabulary entropy.
      act_mask: ``[..., K]`` bool.
      level: ``"token"``: sum over valid tokens, count = valid tokens. ``"action"``: each
        action's mean token entropy H-bar, summed over actions with >= 1 token, count = actions.
    """
    chex.assert_equal_shape([entropy, act_mask])
    m = act_mask.astype(bool)
    if level == "token":
        return masked_sum_count(entropy, m)
    if level != "action":
        raise ValueError(f"level must be 'token' or 'action', got {level!r}")
    per_action = jnp.sum(jnp.where(m, entropy.astype(jnp.float32), 0.0), axis=-1)
    n_tok = jnp.sum(m, axis=-1, dtype=jnp.float32)
    return masked_sum_count(per_action / jnp.maximum(n_tok, 1.0), n_tok > 0)


def _clipped_policy_sums(log_ratio, adv, mask, clip_eps, entropy, ent_mask, ent_level, ent_coef) -> LossSums:
    """Clipped surrogate, k3 KL, clip fraction and entropy bonus over ``mask`` as :class:`LossSums`."""
    pg, count = masked_sum_count(clipped_surrogate(log_ratio, adv.astype(jnp.float32), clip_eps), mask)
    kl, _ = approx_kl_k3(log_ratio, mask)
    cf, _ = clip_fraction(log_ratio, mask, clip_eps)
    if entropy is not None:
        ent, _ = entropy_bonus(entropy, ent_mask, level=ent_level)
    elif ent_coef != 0.0:
        raise ValueError("ent_coef != 0 needs entropy")
    else:
        ent = jnp.zeros((), jnp.float32)
    return LossSums(loss=pg - ent_coef * ent, count=count,
                    metrics={"pg_loss": pg, "entropy": ent, "approx_kl": kl, "clip_frac": cf})


def appo_policy_loss(
    logp_new: jax.Array,
    logp_old: jax.Array,
    act_mask: jax.Array,
    adv: jax.Array,
    *,
    clip_eps: float = 0.2,
    norm: str = "sum",
    word_count: jax.Array | None = None,
    entropy: jax.Array | None = None,
    ent_coef: float = 0.0,
    action_mask: jax.Array | None = None,
) -> LossSums:
    """Action-level PPO (APPO) loss: one ratio per action from the normalized joint log-prob.

    ``L = -mean[min(rho A, clip(rho) A)] - c_H * mean[H-bar]`` over valid actions, as sums.

    Args:
      logp_new, logp_old: ``[..., K]`` float, per-token log-probs (new policy, behaviour).
      act_mask: ``[..., K]`` bool, valid action tokens.
      adv: ``[...]`` float, (normalized) action-level advantages.
      norm: ``sum`` | ``token`` | ``word`` normalization of the joint log-prob.
      word_count: ``[...]`` int, needed for ``word``.
      entropy: optional ``[..., K]`` float per-token entropy (needed when ``ent_coef != 0``).
      action_mask: ``[...]`` bool valid actions; default: actions with >= 1 token.

    Returns:
      :class:`LossSums` with count = valid actions and metrics ``pg_loss``, ``entropy``,
      ``approx_kl``, ``clip_frac`` (sums over valid actions).
    """
    chex.assert_equal_shape([logp_new, logp_old, act_mask])
    chex.assert_shape(adv, logp_new.shape[:-1])
    if action_mask is None:
        action_mask = jnp.any(act_mask.astype(bool), axis=-1)
    chex.assert_shape(action_mask, adv.shape)
    am = action_mask.astype(bool)
    l_new = action_logprob(logp_new, act_mask, norm=norm, word_count=word_count)
    l_old = action_logprob(logp_old, act_mask, norm=norm, word_count=word_count)
    log_ratio = jnp.where(am, l_new - l_old, 0.0)
    ent_mask = jnp.logical_and(act_mask.astype(bool), am[..., None])
    return _clipped_policy_sums(log_ratio, adv, am, clip_eps, entropy, ent_mask, "action", ent_coef)


def tppo_policy_loss(
    logp_new: jax.Array,
    logp_old: jax.Array,
    act_mask: jax.Array,
    adv: jax.Array,
    *,
    clip_eps: float = 0.2,
    entropy: jax.Array | None = None,
    ent_coef: float = 0.0,
) -> LossSums:
    """Token-level PPO (TPPO) loss: one ratio per token.

    Args:
      logp_new, logp_old: ``[..., K]`` float per-token log-probs.
      act_mask: ``[..., K]`` bool valid tokens (token-level decision points).
      adv: ``[..., K]`` float (normalized) token-level advantages.
      entropy: optional ``[..., K]`` float per-token entropy.

    Returns:
      :class:`LossSums` with count = valid tokens and metrics ``pg_loss``, ``entropy``,
      ``approx_kl``, ``clip_frac`` (sums over valid tokens).
    """
    chex.assert_equal_shape([logp_new, logp_old, act_mask, adv])
    m = act_mask.astype(bool)
    log_ratio = jnp.where(m, logp_new.astype(jnp.float32) - logp_old.astype(jnp.float32), 0.0)
    return _clipped_policy_sums(log_ratio, adv, m, clip_eps, entropy, m, "token", ent_coef)


# ----------------------------------------------------------------------------------------------
# Value loss.


def huber(err: jax.Array, delta: float = 10.0) -> jax.Array:
    """Symmetric Huber: ``e^2/2`` if ``|e| <= delta`` else ``delta * (|e| - delta/2)``.

    (G1's version is zero for ``e < -delta``; this one is not — quirk #7.) Equals
    ``optax.huber_loss(err, delta=delta)``.
    """
    abs_err = jnp.abs(err)
    quad = jnp.minimum(abs_err, delta)
    return 0.5 * quad * quad + delta * (abs_err - quad)


def value_loss(
    value: jax.Array,
    value_old: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    *,
    clip_eps: float | None = 0.2,
    kind: str = "huber",
    huber_delta: float = 10.0,
    coef: float = 1.0,
) -> LossSums:
    """Clipped value loss ``c_V * max(h(R - V), h(R - V_clip))``, ``V_clip = V_old + clip(V - V_old)``.

    Args:
      value: ``[...]`` float, new critic values (action ``[S, B, N]`` or token ``[S, B, N, K]``).
      value_old: same shape, values at rollout time.
      returns: same shape, GAE returns.
      mask: same shape, bool, valid decision points.
      clip_eps: value clip epsilon; ``None`` disables clipping.
      kind: ``"huber"`` (symmetric, ``huber_delta``) or ``"mse"`` (``e^2 / 2``).
      coef: c_V.

    Returns:
      :class:`LossSums` with count = valid points; metrics ``value_loss`` (without ``coef``)
      and ``clip_frac`` (points where the clipped branch is larger).
    """
    if kind not in VALUE_LOSSES:
        raise ValueError(f"value loss must be one of {VALUE_LOSSES}, got {kind!r}")
    chex.assert_equal_shape([value, value_old, returns, mask])
    h = (lambda e: huber(e, huber_delta)) if kind == "huber" else (lambda e: 0.5 * jnp.square(e))
    v = value.astype(jnp.float32)
    ret = returns.astype(jnp.float32)
    loss_unclipped = h(ret - v)
    if clip_eps is None:
        per = loss_unclipped
        clipped = jnp.zeros_like(per)
    else:
        v_old = value_old.astype(jnp.float32)
        v_clip = v_old + jnp.clip(v - v_old, -clip_eps, clip_eps)
        loss_clipped = h(ret - v_clip)
        per = jnp.maximum(loss_unclipped, loss_clipped)
        # Inside the clip range V_clip equals V up to rounding: count only points actually clipped.
        clipped = ((jnp.abs(v - v_old) > clip_eps) & (loss_clipped > loss_unclipped)).astype(jnp.float32)
    total, count = masked_sum_count(per, mask)
    cf, _ = masked_sum_count(clipped, mask)
    return LossSums(loss=coef * total, count=count, metrics={"value_loss": total, "clip_frac": cf})


# ----------------------------------------------------------------------------------------------
# Update helpers.


def kl_early_stop_select(
    kl: jax.Array, threshold: float | None, new_tree: Any, old_tree: Any
) -> tuple[Any, jax.Array]:
    """Keeps ``old_tree`` when ``kl > threshold`` (KL early stop), by ``jnp.where`` per leaf.

    Args:
      kl: scalar approx-KL of the pre-step policy against ``logp_old`` on the minibatch.
      threshold: ``kl_stop``; ``None`` never skips.
      new_tree, old_tree: pytrees with the same structure (params and optimizer state).

    Returns:
      ``(selected tree, skipped)`` with ``skipped`` a bool scalar (count it as ``kl_skips``).
    """
    if threshold is None:
        return new_tree, jnp.zeros((), bool)
    skipped = jnp.asarray(kl) > threshold
    tree = jax.tree.map(lambda n, o: jnp.where(skipped, o, n), new_tree, old_tree)
    return tree, skipped


def global_norm(tree: Any) -> jax.Array:
    """Global L2 norm over all leaves of a pytree, float32 scalar."""
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def clip_by_global_norm(tree: Any, max_norm: float | None) -> tuple[Any, jax.Array]:
    """Scales ``tree`` by ``min(1, max_norm / norm)``; returns ``(clipped, norm before clipping)``.

    Use once per agent's LoRA gradient tree and once for the critic
    (docs/algorithm.md#gradient-clipping-and-optimizers). ``max_norm=None`` returns the tree
    unchanged (with its norm).
    """
    norm = global_norm(tree)
    if max_norm is None:
        return tree, norm
    scale = jnp.where(norm > max_norm, max_norm / jnp.maximum(norm, 1e-30), 1.0)
    return jax.tree.map(lambda x: (x * scale).astype(x.dtype), tree), norm


def clip_stacked_by_global_norm(tree: Any, max_norm: float | None) -> tuple[Any, jax.Array]:
    """Per-agent global-norm clipping of a tree whose leaves are stacked ``[agent, ...]``.

    Agent a's norm is taken over slice ``a`` of every leaf. Returns ``(clipped, norms [agent])``.
    """
    leaves = jax.tree.leaves(tree)
    sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32)).reshape(x.shape[0], -1), axis=1)
             for x in leaves)
    norms = jnp.sqrt(sq)
    if max_norm is None:
        return tree, norms
    scale = jnp.where(norms > max_norm, max_norm / jnp.maximum(norms, 1e-30), 1.0)
    clipped = jax.tree.map(
        lambda x: (x * scale.reshape((-1,) + (1,) * (x.ndim - 1))).astype(x.dtype), tree)
    return clipped, norms
