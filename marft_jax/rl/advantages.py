"""Advantage estimators: from a trajectory's scores (and the critic's values, where the estimator
reads them) to the update's decision points, placed rewards, advantages and return targets.

Estimators are registered by name (:func:`register`) and chosen by ``algo.advantage``
(docs/algorithm.md#advantage-estimators):

* ``gae`` (needs the critic): MARFT's backups along the team graph's link table
  (:func:`marft_jax.rl.backups.marft_gae`) of the placed team reward, bootstrapped from the
  critic's values.
* ``group`` (critic-free, the GRPO family for teams): each problem is played by the team
  ``rollout.group_size`` times in consecutive rows; the team's return minus its group's mean
  (divided by the group's std with ``algo.group_scale=std``, GRPO; not with ``none``, Dr. GRPO)
  is placed like ``gae``'s reward and carried back along the same link table with zero values
  and λ = 1, so it reaches every agent's action (action level) or token (token level) that the
  graph links to the answer.

Everything here is a pure function of arrays with the canonical ``[step, batch, agent, token]``
layout (:mod:`marft_jax.rl.layout`); :mod:`marft_jax.train.prepare` computes the values (one
feature pass) and runs :func:`estimate` in its jitted program.

A new estimator is one function ``(AdvantageInputs, AdvantageConfig) -> Advantages`` and its
:func:`register` call (in any module, e.g. a test); nothing else changes.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from marft_jax.config import AlgoConfig, ConfigError, PPOConfig, RolloutConfig
from marft_jax.models.critic import value_head
from marft_jax.rl import backups, layout, rewards
from marft_jax.rl import topology as topo


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """What the estimators and the preparation read (static): the run's ``algo`` (estimator,
    level, rewards, backups), ``ppo`` (``logp_old``) and ``rollout`` (``group_size``, the
    training temperature of recomputed log-probs) sections themselves, and the team graph."""

    algo: AlgoConfig = AlgoConfig()
    ppo: PPOConfig = PPOConfig()
    rollout: RolloutConfig = RolloutConfig()
    independent: bool = False           # independent learners (own rewards) without a topology object
    topology: topo.Topology | None = None   # the team graph (None: the chain)
    layer_links: str = "chain"          # the team's layer_links: chain | layer
    share_prefixes: bool = True         # a (row, agent)'s steps share their common prefix (packing)
    chunk: int = 128
    tokens_per_call: int = 4096         # packed slots per forward call (memory bound)

    @property
    def independent_learners(self) -> bool:
        """Independent PPO: each agent learns from its own reward (``independent`` or the graph's)."""
        return self.independent or (self.topology is not None and self.topology.independent)

    @property
    def bootstrap_agent(self) -> int:
        """The agent whose next-step value bootstraps a truncated episode of a shared reward."""
        return 0 if self.topology is None else self.topology.bootstrap_agent

    def links(self, num_steps: int, num_agents: int | None = None) -> topo.LinkTable | None:
        """The backup's link table for ``num_steps`` steps (independent learners: each agent linked
        to itself, ``topology.per_agent_links``); None for the chain without a graph.
        ``num_agents`` is read only without a topology."""
        n = num_agents if self.topology is None else self.topology.num_agents
        if self.independent_learners:
            if n is None:
                raise ValueError("AdvantageConfig.links: independent learners without a topology need num_agents")
            return topo.per_agent_links(num_steps, n)
        return None if self.topology is None else self.topology.links(num_steps, self.layer_links)


@flax.struct.dataclass
class AdvantageInputs:
    """What an estimator reads (S steps, B rows, N agents, K action slots).

    ``act_valid [S, B, N, K]`` bool; ``step_mask``, ``terminal``, ``truncated`` ``[S, B]`` bool;
    ``score [S, B]`` (the team's) and ``agent_score [S, B, N]`` (each agent's) float32;
    ``value`` the critic's value at every position, ``[S, B, N]`` (action level) or
    ``[S, B, N, K]`` (token level), and ``v_boot [B, N]`` each agent's value at its bootstrap
    context (0 where the row does not bootstrap); both None for a critic-free estimator.
    """

    act_valid: jax.Array
    step_mask: jax.Array
    terminal: jax.Array
    truncated: jax.Array
    score: jax.Array
    agent_score: jax.Array
    value: jax.Array | None = None
    v_boot: jax.Array | None = None


class Advantages(NamedTuple):
    """An estimator's results, each ``[S, B, N]`` (action level) or ``[S, B, N, K]`` (token
    level), zero off the decision points: ``value`` the critic's values there (zeros without a
    critic), ``dp`` the decision points (bool), ``placed`` the placed rewards, ``adv`` the
    advantages, ``ret`` the critic's return targets."""

    value: jax.Array
    dp: jax.Array
    placed: jax.Array
    adv: jax.Array
    ret: jax.Array


@dataclasses.dataclass(frozen=True)
class Estimator:
    """A registered estimator: its function and whether the run needs a critic for it (without
    one the run has no critic parameters, feature pass or critic update)."""

    name: str
    fn: Callable[[AdvantageInputs, AdvantageConfig], Advantages]
    needs_critic: bool


ESTIMATORS: dict[str, Estimator] = {}


def register(name: str, *, needs_critic: bool):
    """Register ``fn(inputs, acfg) -> Advantages`` as ``algo.advantage=name`` (a decorator)."""
    def add(fn):
        ESTIMATORS[name] = Estimator(name, fn, needs_critic)
        return fn
    return add


def get(name: str) -> Estimator:
    """The estimator ``algo.advantage=name``; a :class:`~marft_jax.config.ConfigError` naming the
    key and the registered names otherwise (called at build)."""
    if name not in ESTIMATORS:
        raise ConfigError(f"algo.advantage={name!r}: must be one of {sorted(ESTIMATORS)} "
                          "(marft_jax.rl.advantages.register adds one)")
    return ESTIMATORS[name]


def needs_critic(algo: AlgoConfig) -> bool:
    """Whether ``algo.advantage`` reads the critic's values."""
    return get(algo.advantage).needs_critic


def estimate(inputs: AdvantageInputs, acfg: AdvantageConfig) -> Advantages:
    """The run's estimator (``acfg.algo.advantage``) applied to ``inputs``."""
    return get(acfg.algo.advantage).fn(inputs, acfg)


def critic_values(head, feats: jax.Array, boot_feats: jax.Array, boot_valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The critic's values from its cached features (docs/algorithm.md#critic): ``value`` at every
    position, ``feats [S, B, N, H]`` or ``[S, B, N, K, H]`` -> ``[S, B, N]`` / ``[S, B, N, K]``,
    and ``v_boot [B, N]`` float32 from ``boot_feats [B, N, H]``, 0 where ``boot_valid [B, N, L]``
    holds no context (the row does not bootstrap)."""
    v_boot = jnp.where(boot_valid.any(-1), value_head(head, boot_feats), 0.0).astype(jnp.float32)
    return value_head(head, feats), v_boot


def decision_points(act_valid: jax.Array, step_mask: jax.Array, token_level: bool) -> jax.Array:
    """Bool decision points: ``[S, B, N]`` (an agent's action at a played step) or
    ``[S, B, N, K]`` (each of its valid tokens)."""
    return (layout.token_decision_mask(act_valid, step_mask) if token_level
            else layout.action_decision_mask(act_valid, step_mask))


def episode_reward(x: AdvantageInputs, acfg: AdvantageConfig) -> jax.Array:
    """The episode's reward after the ``algo`` transform (bias, scale, clip): the team's, ``[B]``,
    or with independent learners each agent's own mixed with the team mean, ``[B, N]``."""
    algo = acfg.algo
    if acfg.independent_learners:
        own = jax.vmap(lambda s: rewards.final_step_reward(s, x.step_mask), in_axes=2, out_axes=1)(x.agent_score)
        r = rewards.mix_independent_rewards(own, algo.ippo_own_weight)
    else:
        r = rewards.final_step_reward(x.score, x.step_mask)
    return rewards.transform_reward(r, bias=algo.reward_bias, scale=algo.reward_scale, clip=algo.reward_clip)


def placed_reward(r: jax.Array, dp: jax.Array, step_mask: jax.Array, acfg: AdvantageConfig) -> jax.Array:
    """``r`` (:func:`episode_reward`'s shape) placed on the decision points: on every agent's
    own for independent learners, else by ``algo.reward_to`` along the link table."""
    if acfg.independent_learners:
        return rewards.place_reward(r, dp, step_mask, reward_to="all")
    links = acfg.links(step_mask.shape[0], dp.shape[layout.AGENT_AXIS])
    return rewards.place_reward(r, dp, step_mask, reward_to=acfg.algo.reward_to, links=links)


@register("gae", needs_critic=True)
def gae(x: AdvantageInputs, acfg: AdvantageConfig) -> Advantages:
    """MARFT's backup: GAE along the link table from the critic's values (docs/algorithm.md#the-gae-estimator)."""
    dp = decision_points(x.act_valid, x.step_mask, acfg.algo.token_level)
    value = jnp.where(dp, x.value, 0.0)
    placed = placed_reward(episode_reward(x, acfg), dp, x.step_mask, acfg)
    v_boot = x.v_boot if acfg.independent_learners else x.v_boot[:, acfg.bootstrap_agent]
    adv, ret = backups.marft_gae(placed, value, dp, x.step_mask, x.terminal, x.truncated, v_boot,
                                 gamma=acfg.algo.discount, lam=acfg.algo.gae_lambda,
                                 reference_semantics=acfg.algo.reference_semantics,
                                 links=acfg.links(x.step_mask.shape[0], x.act_valid.shape[layout.AGENT_AXIS]))
    return Advantages(value, dp, placed, adv, ret)


def group_baselined(r: jax.Array, group_size: int, scale: str, eps: float = 1e-6) -> jax.Array:
    """``r [B, ...]`` minus the mean of its group of ``group_size`` consecutive rows, divided by the
    group's (population) std with ``scale="std"`` (a group whose rewards are all equal gets 0)."""
    b = r.shape[0]
    if b % group_size:
        raise ValueError(f"rollout.group_size={group_size} does not divide the batch's {b} rows")
    g = r.reshape((b // group_size, group_size) + r.shape[1:])
    centred = g - g.mean(axis=1, keepdims=True)
    if scale == "std":
        centred = centred / (g.std(axis=1, keepdims=True) + eps)
    return centred.reshape(r.shape)


@register("group", needs_critic=False)
def group(x: AdvantageInputs, acfg: AdvantageConfig) -> Advantages:
    """Critic-free group baseline (GRPO / Dr. GRPO for teams, docs/algorithm.md#the-group-estimator): the
    group-baselined episode reward, placed and backed up along the link table with zero values,
    λ = 1 and the level's γ (no bootstrap: a truncated episode's tail counts 0)."""
    algo = acfg.algo
    dp = decision_points(x.act_valid, x.step_mask, algo.token_level)
    zero = jnp.zeros(dp.shape, jnp.float32)
    a = group_baselined(episode_reward(x, acfg), acfg.rollout.group_size, algo.group_scale)
    placed = placed_reward(a, dp, x.step_mask, acfg)
    n = x.act_valid.shape[layout.AGENT_AXIS]
    v_boot = jnp.zeros((x.step_mask.shape[1], n) if acfg.independent_learners else x.step_mask.shape[1:],
                       jnp.float32)
    adv, ret = backups.marft_gae(placed, zero, dp, x.step_mask, x.terminal, x.truncated, v_boot,
                                 gamma=algo.discount, lam=1.0, links=acfg.links(x.step_mask.shape[0], n))
    return Advantages(zero, dp, placed, adv, ret)


@jax.named_scope("prepare/backups")
def advantages_fn(value, act_valid, step_mask, score, agent_score, terminal, truncated, v_boot, *,
                  acfg: AdvantageConfig) -> Advantages:
    """:func:`estimate` with its inputs as arguments (``value``, ``v_boot``: None for a
    critic-free estimator)."""
    return estimate(AdvantageInputs(act_valid=act_valid, step_mask=step_mask, terminal=terminal,
                                    truncated=truncated, score=score, agent_score=agent_score,
                                    value=value, v_boot=v_boot), acfg)


advantages = jax.jit(advantages_fn, static_argnames=("acfg",))
