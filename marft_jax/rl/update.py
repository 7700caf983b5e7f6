"""PPO updates for the team: critic step, then the agents by schedule, all inside one jit.

Schedules (docs/algorithm.md#agent-schedules):

* ``sequential`` (default): a ``lax.scan`` over agents m = 0 … N-1 updates agent m's adapter
  with its own optimizer state (both stacked on the agent axis and passed as scan ``xs``). With
  ``happo_weighting`` the carry holds the per-(step, row) factor
  ``M^m = Π_{l<m} clip(exp(ℓ^l_after − ℓ^l_old), 1 ± ε_M)`` of the agents already updated in
  this scan, and agent m trains on ``M^m · Â``. The scan follows the team graph's layers
  (``UpdateConfig.layers``, execution order); ``ppo.layer_update`` says how the agents of one
  layer update: ``in_order`` (one after another, each carrying the factor on) or
  ``concurrent`` (``vmap`` over the layer's agents, all from the layer's incoming factor; the
  next layer gets it times the product of the layer's ratios). Layers are padded to the widest
  with slots that neither train nor change the factor (:func:`layer_table`).
* ``concurrent``: every agent is updated from the same minibatch at once (``vmap`` over agents).
* ``interval``: the same scan, but only the agents flagged in ``train_mask`` change (G1 trains
  one agent per span of env samples); the others keep bit-identical parameters and state.

Every PPO epoch and minibatch runs inside the jitted :func:`ppo_update`. Micro-batches
accumulate gradients of *sums* divided by the minibatch's total count, known beforehand from
the masks, so they equal the full-minibatch masked mean (docs/algorithm.md#micro-batches-and-exact-means).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from marft_jax.config import AlgoConfig, OptimConfig, PPOConfig, RolloutConfig
from marft_jax.models import logprobs as lp_lib
from marft_jax.models import sharding
from marft_jax.models.config import ModelConfig
from marft_jax.models.decoder import REMAT_AUTO_LEN, resolve_remat  # noqa: F401 (re-exported)
from marft_jax.models.critic import CriticParams, critic_features_fn, value_head
from marft_jax.models.lora import LoraStack
from marft_jax.rl import layout, losses
from marft_jax.rl.packing import PackedRows, PackedUpdate
from marft_jax.rl.state import TrainState, critic_optimizer, policy_optimizer


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """What the update reads (hashable: a jit static argument): the run's ``ppo``, ``optim``,
    ``algo`` (the decision level) and ``rollout`` (the training temperature, at which every
    log-prob is taken) sections themselves, plus what the run derives from them."""

    ppo: PPOConfig = PPOConfig()
    optim: OptimConfig = OptimConfig()
    algo: AlgoConfig = AlgoConfig()
    rollout: RolloutConfig = RolloutConfig()
    total_updates: int = 1              # optimizer steps of the run: the cosine schedule's length
    # The team graph's layers (Topology.layers), in execution order; None: one agent per layer
    # in index order (the chain).
    layers: tuple[tuple[int, ...], ...] | None = None
    chunk: int = 128
    remat: bool | str | None = None     # decoder.REMAT_POLICIES name; None: auto (decoder.resolve_remat)

    @property
    def token_level(self) -> bool:
        return self.algo.token_level

    @property
    def agent_schedule(self) -> str:
        """How the agents are updated: ``interval`` runs the sequential scan (``train_mask``
        picks the agent that changes)."""
        return "sequential" if self.ppo.agent_schedule == "interval" else self.ppo.agent_schedule

    @property
    def happo_weighting(self) -> bool:
        """HAPPO's factor applies under ``ppo.agent_schedule=sequential`` only."""
        return self.ppo.happo_weighting and self.ppo.agent_schedule == "sequential"


@flax.struct.dataclass
class UpdateBatch:
    """Everything the update reads, canonical layout (S steps, B rows, N agents).

    ctx_tokens/ctx_valid ``[S, B, N, L]`` (None when the policy reads packed rows and the critic
    has no LoRA); act_tokens/act_valid/logp_old ``[S, B, N, K]``;
    adv, ret, v_old, dp_mask ``[S, B, N]`` (action level) or ``[S, B, N, K]`` (token level);
    feats ``[S, B, N, H]`` / ``[S, B, N, K, H]`` cached critic features (ignored with critic
    LoRA); word_count ``[S, B, N]`` int32. ``ret``, ``v_old``, ``feats``: None without a critic
    (a critic-free estimator).
    """

    ctx_tokens: jax.Array
    ctx_valid: jax.Array
    act_tokens: jax.Array
    act_valid: jax.Array
    logp_old: jax.Array
    adv: jax.Array
    ret: jax.Array
    v_old: jax.Array
    dp_mask: jax.Array
    feats: jax.Array
    word_count: jax.Array


def _micro(x: jax.Array, m: int) -> jax.Array:
    """``[R, ...] -> [m, R/m, ...]``: micro-batch ``v`` is rows ``v*R/m .. (v+1)*R/m - 1``.

    Under a context mesh each micro-batch stays split over the data shards (axis 1), so every
    device computes 1/D of every micro-batch. Without the constraint XLA keeps the rows' split on
    the new micro-batch axis (contiguous blocks of rows live on contiguous devices), and the scan
    over micro-batches gathers each one whole onto every device.
    """
    return sharding.constrain_rows(x.reshape((m, x.shape[0] // m) + x.shape[1:]), axis=1)


def _policy_logprobs(base, lora_m: LoraStack, cfg: ModelConfig, ucfg: UpdateConfig, d: dict, remat: bool | None):
    """Per-token log-probs and entropies ``[rows, K]`` of one agent's (micro-)batch ``d``.

    Packed rows (``d["packed"]``, ``d["gather"]``: :mod:`marft_jax.rl.packing`) when the caller
    planned them, else the padded ``ctx ‖ act`` layout.
    """
    agent = jnp.zeros((), jnp.int32)
    if "packed" in d:
        return lp_lib.packed_action_logprobs_fn(
            base, lora_m, agent, d["packed"], d["gather"], d["act_tokens"], d["act_valid"],
            ucfg.rollout.temperature, cfg=cfg, chunk=ucfg.chunk, remat=remat)
    remat = resolve_remat(remat, d["ctx_tokens"].shape[-1] + d["act_tokens"].shape[-1])
    return lp_lib.action_logprobs_fn(
        base, lora_m, agent, d["ctx_tokens"], d["ctx_valid"], d["act_tokens"], d["act_valid"],
        ucfg.rollout.temperature, cfg=cfg, chunk=ucfg.chunk, remat=remat)


def _agent_loss_sums(lora_m: LoraStack, base, cfg: ModelConfig, ucfg: UpdateConfig, d: dict,
                     happo: jax.Array) -> losses.LossSums:
    """Agent m's policy loss over (micro-)batch rows ``d`` as exact sums (``lora_m``: 1 agent)."""
    logp, ent = _policy_logprobs(base, lora_m, cfg, ucfg, d, ucfg.remat)
    if ucfg.token_level:
        return losses.tppo_policy_loss(logp, d["logp_old"], d["dp_mask"], d["adv"] * happo[:, None],
                                       clip_eps=ucfg.ppo.clip_eps, entropy=ent, ent_coef=ucfg.ppo.ent_coef)
    return losses.appo_policy_loss(logp, d["logp_old"], d["act_valid"], d["adv"] * happo,
                                   clip_eps=ucfg.ppo.clip_eps, norm=ucfg.ppo.logprob_norm,
                                   word_count=d["word_count"], entropy=ent, ent_coef=ucfg.ppo.ent_coef,
                                   action_mask=d["dp_mask"])


@jax.named_scope("update/agent_policy_step")
def _agent_update(base, cfg, ucfg, lora_a, opt_a, d, happo, train_flag):
    """One optimizer step for one agent: ``lora_a``/``opt_a`` are its slices (no agent axis).

    Micro-batch gradients of ``loss_sum / total`` accumulate in a scan; ``total`` is the
    minibatch's count of valid decision points, known from the masks beforehand.
    """
    lora_m = _with_agent_axis(lora_a)  # the decoder selects agent 0 of a one-agent stack
    total = jnp.maximum(jnp.sum(d["dp_mask"]), 1).astype(jnp.float32)
    m = ucfg.ppo.micro_batches
    mb = jax.tree.map(lambda x: _micro(x, m), d)
    hb = _micro(happo, m)

    def objective(lora, dm, hm):
        s = _agent_loss_sums(lora, base, cfg, ucfg, dm, hm)
        return s.loss / total, s

    def acc(carry, xs):
        g_acc, s_acc = carry
        (_, s), g = jax.value_and_grad(objective, has_aux=True)(lora_m, *xs)
        return (jax.tree.map(jnp.add, g_acc, g), losses.add_sums(s_acc, s)), None

    zero = jax.eval_shape(lambda: _agent_loss_sums(lora_m, base, cfg, ucfg, jax.tree.map(lambda x: x[0], mb), hb[0]))
    zero = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), zero)
    (grads, sums), _ = jax.lax.scan(acc, (jax.tree.map(jnp.zeros_like, lora_m), zero), (mb, hb))
    grads, grad_norm = losses.clip_by_global_norm(_without_agent_axis(grads), ucfg.ppo.max_grad_norm)
    updates, new_opt = policy_optimizer(ucfg.optim, ucfg.total_updates).update(grads, opt_a, lora_a)
    new_lora = optax.apply_updates(lora_a, updates)
    _, met = losses.finalize(sums)
    (new_lora, new_opt), skipped = losses.kl_early_stop_select(
        met["approx_kl"], ucfg.ppo.kl_stop, (new_lora, new_opt), (lora_a, opt_a))
    apply = jnp.logical_and(train_flag, ~skipped)
    new_lora = jax.tree.map(lambda n, o: jnp.where(apply, n, o), new_lora, lora_a)
    new_opt = jax.tree.map(lambda n, o: jnp.where(apply, n, o), new_opt, opt_a)
    met = dict(met, grad_norm=grad_norm, kl_skipped=(train_flag & skipped).astype(jnp.float32),
               updated=apply.astype(jnp.float32), happo_factor=losses.masked_mean(happo, d["act_valid"].any(-1)))
    return new_lora, new_opt, met


@jax.named_scope("update/happo_factor")
def _happo_factor(base, cfg, ucfg, lora_m, d):
    """``exp(ℓ_after − ℓ_old)`` per row, clipped to ``1 ± happo_clip`` (1 where invalid). [R]."""
    m = ucfg.ppo.micro_batches

    def one(dm):
        logp, _ = _policy_logprobs(base, lora_m, cfg, ucfg, dm, False)
        norm = dict(norm=ucfg.ppo.logprob_norm, word_count=dm["word_count"])
        return (losses.action_logprob(logp, dm["act_valid"], **norm)
                - losses.action_logprob(dm["logp_old"], dm["act_valid"], **norm))

    diff = jax.lax.map(one, jax.tree.map(lambda x: _micro(x, m), d)).reshape(-1)
    ratio = jnp.exp(diff)
    if ucfg.ppo.happo_clip is not None:
        ratio = jnp.clip(ratio, 1.0 - ucfg.ppo.happo_clip, 1.0 + ucfg.ppo.happo_clip)
    valid = d["act_valid"].any(-1)
    return jax.lax.stop_gradient(jnp.where(valid, ratio, 1.0))


def _with_agent_axis(tree):
    return jax.tree.map(lambda x: x[None], tree)


def _without_agent_axis(tree):
    return jax.tree.map(lambda x: x[0], tree)


def layer_table(layers: tuple[tuple[int, ...], ...] | None, num_agents: int, layer_update: str) -> np.ndarray:
    """The sequential scan's agent slots: ``[scan steps, width]`` int32 agent indices.

    ``in_order``: one agent per scan step, the layers' agents in execution order (width 1).
    ``concurrent``: one layer per scan step, padded to the widest layer with ``num_agents`` (a
    slot that neither trains nor changes the HAPPO factor). ``layers=None``: one agent per layer.
    """
    if layers is None:
        layers = tuple((i,) for i in range(num_agents))
    agents = sorted(i for layer in layers for i in layer)
    if agents != list(range(num_agents)):
        raise ValueError(f"the team graph's layers {layers} do not hold agents 0 .. {num_agents - 1} once each")
    if layer_update == "in_order":
        return np.asarray([i for layer in layers for i in layer], np.int32)[:, None]
    if layer_update != "concurrent":
        raise ValueError(f"ppo.layer_update must be 'in_order' or 'concurrent', got {layer_update!r}")
    width = max(len(layer) for layer in layers)
    return np.asarray([list(layer) + [num_agents] * (width - len(layer)) for layer in layers], np.int32)


def update_agents(base, cfg: ModelConfig, ucfg: UpdateConfig, lora: LoraStack, lora_opt, mb: UpdateBatch,
                  train_mask: jax.Array, packed: tuple[PackedRows, jax.Array] | None = None):
    """Update every agent on one minibatch by ``ucfg.agent_schedule``. Returns new (lora, opt, metrics[N]).

    ``packed``: optional ``(rows, gather [N, S*b, K])`` of this minibatch, rows one
    ``[N, u*R_c, T_c]`` PackedRows per length class (:class:`~marft_jax.rl.packing.PackedUpdate`);
    without it the padded contexts are used.
    """
    fields = ("act_tokens", "act_valid", "logp_old", "adv", "dp_mask", "word_count")
    if packed is None:
        fields = ("ctx_tokens", "ctx_valid") + fields
    per_agent = {f: layout.agent_major(getattr(mb, f)) for f in fields}            # [N, R, ...]
    if packed is not None:
        per_agent["packed"], per_agent["gather"] = packed
    num_rows = per_agent["act_tokens"].shape[1]
    ones = jnp.ones((num_rows,), jnp.float32)

    if ucfg.agent_schedule == "concurrent":
        def one(lora_a, opt_a, d, flag):
            return _agent_update(base, cfg, ucfg, lora_a, opt_a, d, ones, flag)
        return jax.vmap(one)(lora, lora_opt, per_agent, train_mask)

    num_agents = train_mask.shape[0]
    use_happo = ucfg.agent_schedule == "sequential" and ucfg.happo_weighting and num_agents > 1
    layer_update = ucfg.ppo.layer_update if ucfg.ppo.agent_schedule == "sequential" else "in_order"
    table = layer_table(ucfg.layers, num_agents, layer_update)
    return _update_layers(base, cfg, ucfg, lora, lora_opt, per_agent, train_mask, table, use_happo)


def _update_layers(base, cfg, ucfg, lora, lora_opt, per_agent: dict, train_mask, table: np.ndarray,
                   use_happo: bool):
    """The sequential scan over the slots of :func:`layer_table` (``[steps, width]``); the chain
    (and ``layer_update=in_order``) is its width-1 case, one agent per scan step.

    Each scan step gathers its slots' adapters, optimizer states and data (a padded slot reads
    the last agent's and does not train), updates them from the same incoming factor (``vmap``
    over the slots when ``width > 1``), and multiplies the factor by the product of the real
    slots' ratios. The new slices leave the scan as ``[steps, width, ...]`` and are scattered back
    onto the agent axis (padded slots dropped). Every agent sits in exactly one slot.
    """
    num_agents = train_mask.shape[0]
    steps, width = table.shape
    slots = jnp.asarray(table)
    real = slots < num_agents                                                    # [steps, width]
    take = lambda tree, idx: jax.tree.map(lambda x: jnp.take(x, idx, axis=0, mode="clip"), tree)
    num_rows = per_agent["act_tokens"].shape[1]

    def one(lora_a, opt_a, d, happo, flag):
        return _agent_update(base, cfg, ucfg, lora_a, opt_a, d, happo, flag)

    def ratio(lora_a, d):
        return _happo_factor(base, cfg, ucfg, _with_agent_axis(lora_a), d)

    def body(happo, xs):
        index, idx, is_real = xs
        lora_w, opt_w, d_w = take(lora, idx), take(lora_opt, idx), take(per_agent, idx)
        flags = jnp.take(train_mask, idx, mode="clip") & is_real
        if width == 1:
            first = lambda tree: jax.tree.map(lambda x: x[0], tree)
            out = one(first(lora_w), first(opt_w), first(d_w), happo, flags[0])
            new_lora, new_opt, met = _with_agent_axis(out)
        else:
            new_lora, new_opt, met = jax.vmap(one, in_axes=(0, 0, 0, None, 0))(lora_w, opt_w, d_w, happo, flags)
        if use_happo:
            def factor(h):
                if width == 1:
                    return h * ratio(_without_agent_axis(new_lora), _without_agent_axis(d_w))
                r = jax.vmap(ratio)(new_lora, d_w)                               # [width, R]
                return h * jnp.prod(jnp.where(is_real[:, None], r, 1.0), axis=0)
            # The last step's factor would only feed agents after it: skip its extra forwards.
            happo = jax.lax.cond(index < steps - 1, factor, lambda h: h, happo)
        return happo, (new_lora, new_opt, met)

    xs = (jnp.arange(steps), slots, real)
    _, out = jax.lax.scan(body, jnp.ones((num_rows,), jnp.float32), xs)
    flat = slots.reshape(-1)

    def scatter(full, ys):
        ys = ys.reshape((steps * width,) + ys.shape[2:])
        return full.at[flat].set(ys, mode="drop")

    new_lora, new_opt, met = out
    met_full = jax.tree.map(lambda y: jnp.zeros((num_agents,) + y.shape[2:], y.dtype), met)
    return (jax.tree.map(scatter, lora, new_lora), jax.tree.map(scatter, lora_opt, new_opt),
            jax.tree.map(scatter, met_full, met))


def critic_values(critic: CriticParams, base, cfg: ModelConfig, ucfg: UpdateConfig, mb: UpdateBatch):
    """Values at every decision point of the minibatch: ``[S, b, N]`` or ``[S, b, N, K]``."""
    if critic.lora is None:
        return value_head(critic.head, mb.feats)
    s, b, n, l = mb.ctx_tokens.shape
    flat = layout.flatten_responses
    feats = critic_features_fn(base, flat(mb.ctx_tokens), flat(mb.ctx_valid), flat(mb.act_tokens),
                               flat(mb.act_valid), cfg=cfg, token_level=ucfg.token_level,
                               lora=critic.lora, remat=resolve_remat(ucfg.remat, l + mb.act_tokens.shape[-1]))
    return layout.unflatten_responses(value_head(critic.head, feats), (s, b, n))


@jax.named_scope("update/critic_step")
def critic_update(base, cfg, ucfg, critic: CriticParams, critic_opt, mb: UpdateBatch):
    def objective(c):
        v = critic_values(c, base, cfg, ucfg, mb)
        s = losses.value_loss(v, mb.v_old, mb.ret, mb.dp_mask, clip_eps=ucfg.ppo.value_clip_eps,
                              kind=ucfg.ppo.value_loss, huber_delta=ucfg.ppo.huber_delta, coef=ucfg.ppo.vf_coef)
        return losses.finalize(s)

    (loss, met), grads = jax.value_and_grad(objective, has_aux=True)(critic)
    grads, grad_norm = losses.clip_by_global_norm(grads, ucfg.ppo.critic_max_grad_norm)
    updates, new_opt = critic_optimizer(ucfg.optim, ucfg.total_updates).update(grads, critic_opt, critic)
    return optax.apply_updates(critic, updates), new_opt, {"value_loss": met["value_loss"],
                                                            "value_clip_frac": met["clip_frac"],
                                                            "grad_norm": grad_norm}


def _take_rows(batch: UpdateBatch, idx: jax.Array) -> UpdateBatch:
    """The minibatch's rows, kept split over the data shards (under a context mesh)."""
    return jax.tree.map(lambda x: sharding.constrain_rows(jnp.take(x, idx, axis=layout.BATCH_AXIS),
                                                          layout.BATCH_AXIS), batch)


@functools.partial(jax.jit, static_argnames=("cfg", "ucfg"), donate_argnames=("state",))
def ppo_update(base, state: TrainState, batch: UpdateBatch, train_mask: jax.Array, train_policy: jax.Array,
               *, cfg: ModelConfig, ucfg: UpdateConfig,
               packed: PackedUpdate | None = None) -> tuple[TrainState, dict[str, Any]]:
    """All PPO epochs and minibatches of one iteration.

    Args:
      base: frozen base parameters (a jit argument, never a closure).
      state: the train state (donated).
      batch: :class:`UpdateBatch` of the whole rollout.
      train_mask: ``[N]`` bool, agents allowed to change (``interval`` trains one).
      train_policy: bool scalar, False during critic warm-up (only the critic trains).
      packed: optional packed policy inputs (:func:`marft_jax.rl.packing.pack_update`, built with
        :func:`~marft_jax.rl.packing.minibatch_perms` of ``state.rng``, so the minibatches are
        the ones drawn here without it). Without it, the padded contexts of ``batch`` are
        used (then ``batch.ctx_tokens`` must be present).
    Returns:
      ``(new_state, metrics)``; per-agent metrics are ``[N]`` means over minibatches.
    """
    chex.assert_rank(train_mask, 1)
    B = batch.act_tokens.shape[layout.BATCH_AXIS]
    nmb = ucfg.ppo.num_minibatches
    if ucfg.ppo.adv_norm == "batch":
        batch = batch.replace(adv=losses.normalize_advantages(batch.adv, batch.dp_mask, mode="batch"))
    flags = jnp.logical_and(train_mask, train_policy)

    def minibatch(state: TrainState, xs):
        idx, packed = xs
        mb = _take_rows(batch, idx)
        if ucfg.ppo.adv_norm == "minibatch":
            mb = mb.replace(adv=losses.normalize_advantages(mb.adv, mb.dp_mask, mode="minibatch"))
        critic, critic_opt, cmet = state.critic, state.critic_opt, {}
        if critic is not None:      # a critic-free estimator's run has none to update
            critic, critic_opt, cmet = critic_update(base, cfg, ucfg, critic, critic_opt, mb)
        lora, lora_opt, amet = update_agents(base, cfg, ucfg, state.lora, state.lora_opt, mb, flags, packed)
        state = state.replace(lora=lora, lora_opt=lora_opt, critic=critic, critic_opt=critic_opt)
        return state, {"critic": cmet, "actor": amet}

    def epoch(state: TrainState, xs):
        return jax.lax.scan(minibatch, state, xs)

    rng, key = jax.random.split(state.rng)
    if packed is None:
        perms = jax.vmap(lambda k: jax.random.permutation(k, B))(jax.random.split(key, ucfg.ppo.epochs))
        xs = (perms.reshape(ucfg.ppo.epochs, nmb, B // nmb), None)
    else:
        chex.assert_shape(packed.perms, (ucfg.ppo.epochs, nmb, B // nmb))
        xs = (packed.perms, (packed.rows, packed.gather))
    state, metrics = jax.lax.scan(epoch, state, xs)
    metrics = jax.tree.map(lambda x: jnp.mean(x.reshape((-1,) + x.shape[2:]), axis=0), metrics)
    return state.replace(rng=rng, step=state.step + 1), metrics
