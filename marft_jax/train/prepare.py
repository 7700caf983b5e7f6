"""From a rollout to the update batch: old log-probs, cached critic features, values,
placed rewards and the chained (or independent) Bellman backups.

``logp_old`` is recomputed with the training forward (same kernels as the update), so the
PPO ratio is exactly 1 at the first minibatch; the sampler's log-probs are only compared as a
mismatch metric (reference §3). Critic features come from one base-only forward per
(step, row, agent) and are reused by every PPO epoch (§5).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax.models import logprobs as lp_lib
from marft_jax.models.config import ModelConfig
from marft_jax.models.critic import CriticParams, critic_features_fn, value_head
from marft_jax.models.lora import LoraStack
from marft_jax.rl import backups, layout, rewards
from marft_jax.rl.trajectory import Trajectory
from marft_jax.rl.update import UpdateBatch


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """Rewards and backups (static)."""

    level: str = "action"
    gamma: float = 0.99
    lam: float = 0.95
    reward_to: str = "last"
    reward_bias: float = 0.0
    reward_scale: float = 1.0
    reward_clip: float | None = None
    independent: bool = False           # independent PPO: own rewards, no chaining
    ippo_own_weight: float = 0.5
    reference_semantics: bool = False
    temperature: float = 1.0
    chunk: int = 128
    rows_per_call: int = 64             # sequences per forward (static shape; memory bound)


def _flat(x: jax.Array) -> jax.Array:
    """``[S, B, N, ...] -> [S*B*N, ...]``."""
    return x.reshape((-1,) + x.shape[3:])


@functools.partial(jax.jit, static_argnames=("cfg", "token_level", "chunk"))
def _logp_and_feats(base, lora: LoraStack, critic_lora, agent, ctx, ctx_valid, act, act_valid, temperature,
                    *, cfg: ModelConfig, token_level: bool, chunk: int):
    logp, ent = lp_lib.action_logprobs_fn(base, lora, agent, ctx, ctx_valid, act, act_valid, temperature,
                                          cfg=cfg, chunk=chunk)
    feats = critic_features_fn(base, ctx, ctx_valid, act, act_valid, cfg=cfg, token_level=token_level,
                               lora=critic_lora)
    return logp, ent, feats


@functools.partial(jax.jit, static_argnames=("cfg",))
def _boot_feats(base, critic_lora, ctx, ctx_valid, *, cfg: ModelConfig):
    dummy = jnp.zeros((ctx.shape[0], 1), jnp.int32)
    return critic_features_fn(base, ctx, ctx_valid, dummy, dummy > 0, cfg=cfg, token_level=False,
                              lora=critic_lora)


def _batched(fn, arrays, rows: int):
    """Run ``fn`` over row chunks of a fixed size (pads the last chunk; static shapes)."""
    n = arrays[0].shape[0]
    outs = []
    for start in range(0, n, rows):
        chunk = [a[start:start + rows] for a in arrays]
        real = chunk[0].shape[0]
        if real < rows:
            chunk = [np.concatenate([c, np.repeat(c[-1:], rows - real, 0)]) for c in chunk]
        res = fn(*chunk)
        outs.append(jax.tree.map(lambda x: np.asarray(x)[:real], res))
    return jax.tree.map(lambda *xs: np.concatenate(xs), *outs)


def prepare_update_batch(base, lora: LoraStack, critic: CriticParams, traj: Trajectory, *,
                         cfg: ModelConfig, acfg: AdvantageConfig) -> tuple[UpdateBatch, dict]:
    """Recompute log-probs, features and values, place rewards, run the backup.

    Returns the :class:`UpdateBatch` (device arrays) and host metrics (explained variance,
    sampler/trainer log-prob mismatch, mean value).
    """
    S, B, N, L, K = traj.shape
    token_level = acfg.level == "token"
    agents = np.broadcast_to(np.arange(N, dtype=np.int32)[None, None, :], (S, B, N)).reshape(-1)
    flat = [np.asarray(_flat(getattr(traj, f))) for f in ("ctx_tokens", "ctx_valid", "act_tokens", "act_valid")]
    rows = min(acfg.rows_per_call, agents.size)

    def call(agent, ctx, ctx_valid, act, act_valid):
        return _logp_and_feats(base, lora, critic.lora, agent, ctx, ctx_valid, act, act_valid,
                               acfg.temperature, cfg=cfg, token_level=token_level, chunk=acfg.chunk)

    logp, ent, feats = _batched(call, [agents] + flat, rows)
    logp = logp.reshape(S, B, N, K)
    feats = feats.reshape((S, B, N) + feats.shape[1:])
    value = np.asarray(value_head(critic.head, jnp.asarray(feats)))

    boot_rows = traj.boot_ctx_tokens.shape[0] * traj.boot_ctx_tokens.shape[1]
    bt = np.asarray(traj.boot_ctx_tokens).reshape(boot_rows, L)
    bv = np.asarray(traj.boot_ctx_valid).reshape(boot_rows, L)
    need = bv.any(-1)
    v_boot = np.zeros((boot_rows,), np.float32)
    if need.any():
        idx = np.flatnonzero(need)
        bf = _batched(lambda c, v: _boot_feats(base, critic.lora, c, v, cfg=cfg), [bt[idx], bv[idx]], rows)
        v_boot[idx] = np.asarray(value_head(critic.head, jnp.asarray(bf)))
    v_boot = v_boot.reshape(B, N)

    act_valid = jnp.asarray(traj.act_valid)
    value, dp, placed, adv, ret = _advantages(
        jnp.asarray(value), act_valid, jnp.asarray(traj.step_mask), jnp.asarray(traj.score),
        jnp.asarray(traj.agent_score), jnp.asarray(traj.terminal), jnp.asarray(traj.truncated),
        jnp.asarray(v_boot), acfg=acfg)
    batch = UpdateBatch(ctx_tokens=jnp.asarray(traj.ctx_tokens), ctx_valid=jnp.asarray(traj.ctx_valid),
                        act_tokens=jnp.asarray(traj.act_tokens), act_valid=act_valid,
                        logp_old=jnp.asarray(logp), adv=adv, ret=ret, v_old=value, dp_mask=dp,
                        feats=jnp.asarray(feats), word_count=jnp.asarray(traj.word_count))
    metrics = _prepare_metrics(np.asarray(value), np.asarray(ret), np.asarray(dp), np.asarray(placed),
                               logp, np.asarray(traj.sample_logp), np.asarray(traj.act_valid), ent)
    return batch, metrics


@functools.partial(jax.jit, static_argnames=("acfg",))
def _advantages(value, act_valid, step_mask, score, agent_score, terminal, truncated, v_boot, *,
                acfg: AdvantageConfig):
    """Decision masks, placed rewards and the backup, in one jitted program."""
    token_level = acfg.level == "token"
    dp = (layout.token_decision_mask(act_valid, step_mask) if token_level
          else layout.action_decision_mask(act_valid, step_mask))
    value = jnp.where(dp, value, 0.0)
    if acfg.independent:
        own = jax.vmap(lambda s: rewards.final_step_reward(s, step_mask), in_axes=2, out_axes=1)(agent_score)
        r = rewards.mix_independent_rewards(own, acfg.ippo_own_weight)               # [B, N]
        r = rewards.transform_reward(r, bias=acfg.reward_bias, scale=acfg.reward_scale, clip=acfg.reward_clip)
        placed = rewards.place_reward(r, dp, step_mask, reward_to="all")
        adv, ret = backups.independent_gae(placed, value, dp, step_mask, terminal, truncated, v_boot,
                                           gamma=acfg.gamma, lam=acfg.lam)
    else:
        r = rewards.final_step_reward(score, step_mask)                               # [B]
        r = rewards.transform_reward(r, bias=acfg.reward_bias, scale=acfg.reward_scale, clip=acfg.reward_clip)
        placed = rewards.place_reward(r, dp, step_mask, reward_to=acfg.reward_to)
        adv, ret = backups.marft_gae(placed, value, dp, step_mask, terminal, truncated, v_boot[:, 0],
                                     gamma=acfg.gamma, lam=acfg.lam,
                                     reference_semantics=acfg.reference_semantics)
    return value, dp, placed, adv, ret


def _prepare_metrics(value, ret, dp, placed, logp, sample_logp, act_valid, ent) -> dict:
    v, r = value[dp], ret[dp]
    var_r = float(np.var(r)) if r.size else 0.0
    ev = 1.0 - float(np.var(r - v)) / var_r if var_r > 1e-12 else 0.0
    diff = np.abs(logp - sample_logp)[act_valid]
    return {
        "critic/explained_var": ev,
        "critic/value_mean": float(v.mean()) if v.size else 0.0,
        "critic/return_mean": float(r.mean()) if r.size else 0.0,
        "rollout/logp_mismatch": float(diff.mean()) if diff.size else 0.0,
        "rollout/entropy": float(ent.reshape(act_valid.shape)[act_valid].mean()) if act_valid.any() else 0.0,
        "rewards/placed_sum_mean": float(placed.reshape(placed.shape[0], placed.shape[1], -1).sum((0, 2)).mean()),
    }
