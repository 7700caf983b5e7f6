"""From a rollout to the update batch: old log-probs, cached critic features, values,
placed rewards and the Bellman backups along the team graph's link table.

``logp_old`` comes from the sampler (``logp_old="sampler"``, the default): it returns each
token's log-prob under the policy itself (full vocabulary, the training temperature, the same
parameters), which is what a recompute forward would give up to float rounding (~1e-6), so the
PPO ratio is 1 at the first minibatch to that precision. ``logp_old="recompute"`` runs the
training forward instead (same kernels as the update; the ratio is then exactly 1) and logs the
sampler's disagreement as ``rollout/logp_mismatch`` (docs/algorithm.md#sampling-and-log-probs).
Critic features come from one base-only forward over *packed* sequences
(:mod:`marft_jax.rl.packing`: work follows the valid tokens, not the context bucket) and are
reused by every PPO epoch (docs/algorithm.md#critic).

The host only plans: it packs the sequences (the packed shapes come from the lengths) and
uploads the rows, gather indices and trajectory arrays once. Everything after that is one
jitted program (:func:`_values_and_backups`: feature pass, value head, bootstrap values, placed
rewards, backups), and the metrics read its results with one transfer at the end. The recompute
forward (``logp_old="recompute"``) is a second jitted program, dispatched before it with its
results left on the device: as two programs, the peak memory is the larger of the two passes'
rather than what one schedule of both could keep live together.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from marft_jax.models import decoder, sharding
from marft_jax.models import logprobs as lp_lib
from marft_jax.models.config import ModelConfig
from marft_jax.models.critic import CriticParams
from marft_jax.models.lora import LoraStack
from marft_jax.rl import advantages, layout, packing
from marft_jax.rl.advantages import AdvantageConfig
from marft_jax.rl.trajectory import Trajectory
from marft_jax.rl.update import UpdateBatch


@dataclasses.dataclass
class PrepareShapes:
    """The run's packed shapes for the feature pass and the recompute forward (grow-only caches)."""

    features: packing.ShapePolicy = dataclasses.field(default_factory=packing.ShapePolicy)
    logprobs: packing.ShapePolicy = dataclasses.field(default_factory=packing.ShapePolicy)


@jax.named_scope("prepare/critic_features")
def _packed_hidden_at_fn(base, critic_lora, rows: tuple[packing.PackedRows, ...], gather, *, cfg: ModelConfig):
    """Base (+ critic LoRA) hidden states of packed rows, one ``[C_c, r_c, T_c]`` per length class
    (``C_c`` calls of ``r_c`` rows, run one after another), read at ``gather [G, P]`` flat
    indices (classes end to end) -> ``[G, P, H]``."""
    agent = None if critic_lora is None else jnp.zeros((), jnp.int32)

    def one(r):
        return decoder.forward_packed(base, r, cfg=cfg, lora=critic_lora, agent=agent)

    # Read each class where it lies, [C, r·T, H] (the row-sharded axis whole within each call),
    # instead of flattening the calls end to end: under a data mesh the flat [C·r·T, H] view is
    # not split contiguously, and XLA all-gathered every hidden state onto every device before
    # the gather; indexed per (call, slot), each device gathers its own slots and one all-reduce
    # of the [G, P, H] result combines them.
    out, start = None, 0
    for r in rows:
        hidden = jax.lax.map(one, r)                                   # [C, r·T, H]
        c, n = hidden.shape[:2]
        local = gather - start
        at = jnp.clip(local, 0, c * n - 1)
        got = hidden[at // n, at % n]                                  # [G, P, H]
        out = got if out is None else jnp.where(((local >= 0) & (local < c * n))[..., None], got, out)
        start += c * n
    return out


_packed_hidden_at = jax.jit(_packed_hidden_at_fn, static_argnames=("cfg",))


@functools.partial(jax.jit, static_argnames=("cfg", "chunk"))
@jax.named_scope("prepare/old_logprobs")
def _packed_logprobs(base, lora: LoraStack, rows: packing.PackedRows, gather, act_tokens, act_valid, temperature,
                     *, cfg: ModelConfig, chunk: int):
    """Every agent's old log-probs from packed rows: rows ``[N, R_c, T_c]`` per class, gather
    ``[N, n, K]``, actions ``[S, B, N, K]`` (``n = S*B``) -> ``(logp, entropy)`` ``[S, B, N, K]``
    (agent ``i`` with its own adapter)."""
    def one(xs):
        i, r, g, a, av = xs
        return lp_lib.packed_action_logprobs_fn(base, lora, i, r, g, a, av, temperature, cfg=cfg, chunk=chunk)

    agents = jnp.arange(gather.shape[0], dtype=jnp.int32)
    out = jax.lax.map(one, (agents, rows, gather, layout.agent_major(act_tokens), layout.agent_major(act_valid)))
    return jax.tree.map(lambda x: layout.from_agent_major(x, act_tokens.shape[:2]), out)


@flax.struct.dataclass
class _BackupInputs:
    """The trajectory arrays the device program reads (S steps, B rows, N agents, K action
    slots, L context slots): ``act_valid [S, B, N, K]`` bool, ``step_mask``, ``terminal``,
    ``truncated`` ``[S, B]`` bool, ``score [S, B]`` and ``agent_score [S, B, N]`` float32,
    ``boot_ctx_valid [B, N, L]`` bool."""

    act_valid: jax.Array
    step_mask: jax.Array
    score: jax.Array
    agent_score: jax.Array
    terminal: jax.Array
    truncated: jax.Array
    boot_ctx_valid: jax.Array


@flax.struct.dataclass
class _Prepared:
    """The device program's results: ``feats [S, B, N, (K,) H]`` (parameter dtype), ``value``
    (masked to the decision points), ``dp`` (the decision points), ``placed`` (rewards),
    ``adv``, ``ret``, all ``[S, B, N]`` or ``[S, B, N, K]``; ``v_boot [B, N]`` float32 (0 where
    the row does not bootstrap)."""

    feats: jax.Array
    value: jax.Array
    v_boot: jax.Array
    dp: jax.Array
    placed: jax.Array
    adv: jax.Array
    ret: jax.Array


def _split_rows(x: _BackupInputs) -> _BackupInputs:
    """Every row's values and backup depend on that row alone: under a context mesh they stay
    split over the row shards (else each device would compute the whole batch's backup)."""
    return _BackupInputs(**{f.name: sharding.constrain_rows(getattr(x, f.name), axis=0 if f.name == "boot_ctx_valid" else 1)
                            for f in dataclasses.fields(x)})


@functools.partial(jax.jit, static_argnames=("cfg", "acfg", "n_main"))
def _values_and_backups(base, critic: CriticParams, calls: tuple[packing.PackedRows, ...], gather,
                        x: _BackupInputs, *, cfg: ModelConfig, acfg: AdvantageConfig, n_main: int) -> _Prepared:
    """The feature pass over the packed rows (``calls``, ``gather``: :func:`feature_inputs`, the
    first ``n_main`` gathered sequences the decision points, then the bootstrap contexts), the
    value head, the bootstrap values and the backup, in one program."""
    S, B, N, K = x.act_valid.shape
    out = _packed_hidden_at_fn(base, critic.lora, calls, gather, cfg=cfg)
    x = _split_rows(x)
    feats = layout.unflatten_responses(out[:n_main] if acfg.algo.token_level else out[:n_main, 0], (S, B, N))
    feats = sharding.constrain_rows(feats, axis=1)
    boot = sharding.constrain_rows(layout.unflatten_agents(out[n_main:, 0], N), axis=0)
    value, v_boot = advantages.critic_values(critic.head, feats, boot, x.boot_ctx_valid)
    value, dp, placed, adv, ret = advantages.advantages_fn(
        value, x.act_valid, x.step_mask, x.score, x.agent_score, x.terminal,
        x.truncated, v_boot, acfg=acfg)
    return _Prepared(feats=feats, value=value, v_boot=v_boot, dp=dp, placed=placed, adv=adv, ret=ret)


@functools.partial(jax.jit, static_argnames=("acfg",))
def _critic_free_backups(x: _BackupInputs, *, acfg: AdvantageConfig) -> _Prepared:
    """A critic-free estimator's program: no feature pass, no values (``feats``, ``v_boot`` None)."""
    x = _split_rows(x)
    value, dp, placed, adv, ret = advantages.advantages_fn(
        None, x.act_valid, x.step_mask, x.score, x.agent_score, x.terminal, x.truncated, None, acfg=acfg)
    return _Prepared(feats=None, value=value, v_boot=None, dp=dp, placed=placed, adv=adv, ret=ret)


def backup_inputs(traj: Trajectory) -> _BackupInputs:
    """The trajectory arrays :func:`_values_and_backups` reads besides the packed rows."""
    return _BackupInputs(act_valid=traj.act_valid, step_mask=traj.step_mask, score=traj.score,
                         agent_score=traj.agent_score, terminal=traj.terminal, truncated=traj.truncated,
                         boot_ctx_valid=traj.boot_ctx_valid)


def _calls(rows: packing.PackedRows, per_call: int) -> packing.PackedRows:
    """``[R, T]`` -> ``[R / per_call, per_call, T]`` (R is a multiple of ``per_call``)."""
    return jax.tree.map(lambda x: x.reshape((-1, per_call) + x.shape[1:]), rows)


def _per_call(rows: int, row_len: int, tokens_per_call: int, multiple: int = 1) -> int:
    """Rows per forward call: at most ``tokens_per_call`` slots, a multiple of ``multiple`` (the
    data shards each call is split over)."""
    per = max(1, min(rows, tokens_per_call // row_len))
    return max(multiple, per // multiple * multiple)


def _host(x) -> np.ndarray:
    """A device result on this host (gathered from other processes' devices where split)."""
    return sharding.to_host(x)


def _place_rows(placement, tree, axis: int):
    """Host arrays on the device, split over the placement's row shards on ``axis`` (None: this
    process's first device, as a 1-device mesh)."""
    from marft_jax.models.placement import Placement

    return (placement or Placement.single()).tree_rows(tree, axis)


def _upload(placement, tree):
    """Host arrays on the device, replicated over the placement's mesh (None: this process's
    first device, as a 1-device mesh)."""
    from marft_jax.models.placement import Placement

    return (placement or Placement.single()).replicate(tree)


def feature_inputs(traj: Trajectory, *, token_level: bool, tokens_per_call: int, policy: packing.ShapePolicy,
                   placement=None, share: bool = False):
    """The feature pass's packed inputs: ``(calls, gather, n_main, stats)``, one ``[C, r, T]``
    :class:`~marft_jax.models.decoder.PackedRows` per length class (``C`` calls of ``r`` rows),
    ``gather [G, P]`` flat read indices, the number of decision-point sequences (the bootstrap
    contexts follow them) and the pass's token counts.

    ``placement`` (:class:`~marft_jax.train.placement.Placement`): each call's rows are split
    over its row shards (``policy.row_multiple`` keeps them divisible). ``share``: the contexts
    of one (row, agent) over the steps (and its bootstrap context after them) share their
    common prefix (:func:`marft_jax.rl.packing.share_prefixes`).
    """
    S, B, N, L, K = traj.shape
    if traj.critic_ctx_tokens is not None:   # the joint history (non-chain team graphs)
        ctx, cv = np.asarray(traj.critic_ctx_tokens), np.asarray(traj.critic_ctx_valid)
    else:
        ctx, cv = np.asarray(traj.ctx_tokens), np.asarray(traj.ctx_valid)
    act, av = np.asarray(traj.act_tokens), np.asarray(traj.act_valid)
    bt, bv = np.asarray(traj.boot_ctx_tokens), np.asarray(traj.boot_ctx_valid)
    flat, flat_boot = layout.flatten_responses, layout.flatten_agents
    if token_level:   # the critic reads every action position: ctx ‖ act
        seqs = [packing.sequence(c, v, a, m) for c, v, a, m in zip(flat(ctx), flat(cv), flat(act), flat(av))]
    else:             # only the last context token: the response is not an input
        seqs = [packing.sequence(c, v) for c, v in zip(flat(ctx), flat(cv))]
    n_main = len(seqs)
    seqs += [packing.sequence(c, v) for c, v in zip(flat_boot(bt), flat_boot(bv))]
    n_ctx = np.concatenate([flat(cv).sum(-1), flat_boot(bv).sum(-1)])
    s_, b_, i_ = np.meshgrid(np.arange(S), np.arange(B), np.arange(N), indexing="ij")
    chains = list(zip(zip(b_.ravel().tolist(), i_.ravel().tolist()), s_.ravel().tolist()))
    chains += [((b, i), S) for b in range(B) for i in range(N)]
    units = packing.share_prefixes(seqs, chains if share else None)
    chosen = policy.choose([[len(u.tokens) for u in units]])
    # Each class runs in calls of at most tokens_per_call slots (its rows rounded up to whole calls).
    m = policy.row_multiple
    per_call = [_per_call(r, t, tokens_per_call, m) for r, t in chosen]
    shape = tuple((-(-r // p) * p, t) for (r, t), p in zip(chosen, per_call))
    read = K if token_level else 1
    classes, gather = packing.pack_group(seqs, np.maximum(n_ctx - 1, 0), read, shape, units=units, branches=share,
                                         segment_align=policy.segment_align)
    calls = tuple(_place_rows(placement, _calls(rows, p), 1) for rows, p in zip(classes, per_call))
    gather = _upload(placement, gather)
    stats = {"valid_tokens": int(sum(len(x) for x in seqs)), "unique_tokens": int(sum(len(u.tokens) for u in units)),
             "computed_tokens": packing.shape_slots(shape)}
    return calls, gather, n_main, stats


def critic_features(base, critic: CriticParams, traj: Trajectory, *, cfg: ModelConfig, token_level: bool,
                    tokens_per_call: int, policy: packing.ShapePolicy,
                    placement=None, share: bool = False) -> tuple[np.ndarray, np.ndarray, dict]:
    """Packed critic features of every decision point and of the bootstrap contexts.

    Returns ``(feats [S, B, N, H] or [S, B, N, K, H], boot_feats [B, N, H], stats)``; stats
    holds the pass's ``valid_tokens``, ``unique_tokens`` and ``computed_tokens``. ``placement``,
    ``share``: see :func:`feature_inputs`.
    """
    S, B, N, L, K = traj.shape
    calls, gather, n_main, stats = feature_inputs(traj, token_level=token_level, tokens_per_call=tokens_per_call,
                                                  policy=policy, placement=placement, share=share)
    out = _host(_packed_hidden_at(base, critic.lora, calls, gather, cfg=cfg))
    feats = out[:n_main] if token_level else out[:n_main, 0]
    feats = layout.unflatten_responses(feats, (S, B, N))
    boot = layout.unflatten_agents(out[n_main:, 0], N)
    return feats, boot, stats


def recompute_logprobs(base, lora: LoraStack, traj: Trajectory, *, cfg: ModelConfig, temperature: float,
                       chunk: int, policy: packing.ShapePolicy, placement=None, share: bool = False,
                       actions: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, jax.Array, dict]:
    """The training forward's log-probs and entropies ``[S, B, N, K]`` of every action, left on
    the device (packed; ``share``: shared step prefixes, as the update). ``actions``: the
    trajectory's ``(act_tokens, act_valid)`` already on the device (uploaded here when None)."""
    S, B, N, L, K = traj.shape
    perms = np.arange(B, dtype=np.int32)[None, None]
    packed, stats = packing.pack_update(np.asarray(traj.ctx_tokens), np.asarray(traj.ctx_valid),
                                      np.asarray(traj.act_tokens), np.asarray(traj.act_valid), perms,
                                      micro_batches=1, policy=policy, share=share)
    if actions is None:
        actions = _upload(placement, (np.asarray(traj.act_tokens), np.asarray(traj.act_valid)))
    gather = packed.gather[0, 0]                   # [N, S*B, K]
    logp, ent = _packed_logprobs(base, lora, _place_rows(placement, jax.tree.map(lambda x: x[0, 0], packed.rows), 1),
                                 _upload(placement, gather),
                                 *actions, temperature, cfg=cfg, chunk=chunk)
    return logp, ent, stats


def prepare_update_batch(base, lora: LoraStack, critic: CriticParams | None, traj: Trajectory, *,
                         cfg: ModelConfig, acfg: AdvantageConfig, shapes: PrepareShapes | None = None,
                         keep_contexts: bool = False, placement=None) -> tuple[UpdateBatch, dict]:
    """Old log-probs, features and values, placed rewards, the advantages (``algo.advantage``).

    The host plans the packed shapes and uploads the trajectory once; the device part is one
    jitted program (:func:`_values_and_backups`, or :func:`_critic_free_backups` for an
    estimator without a critic), after the recompute forward's with ``logp_old="recompute"``;
    the metrics read its results in one transfer at the end.

    Args:
      critic: the critic (None exactly when the estimator is critic-free: no feature pass).
      shapes: the run's packed-shape caches (a fresh one per call when None: more compiles).
      keep_contexts: keep the padded contexts in the batch (the update's padded path, or a
        critic LoRA that recomputes its features); otherwise ``ctx_tokens``/``ctx_valid`` are None
        and the update reads packed rows.
      placement: the run's :class:`~marft_jax.train.placement.Placement` (None: one device);
        the forwards' packed rows are split over its row shards.
    Returns the :class:`UpdateBatch` (device arrays; ``feats``, ``v_old``, ``ret`` None without a
    critic) and host metrics (explained variance, sampler/trainer log-prob mismatch, mean value,
    token counts of the pass).
    """
    with_critic = advantages.needs_critic(acfg.algo)
    if with_critic != (critic is not None):
        raise ValueError(f"algo.advantage={acfg.algo.advantage!r} "
                         + ("needs a critic: the train state has none" if with_critic
                            else "is critic-free: build the train state without a critic"))
    if with_critic and critic.lora is not None and traj.critic_ctx_tokens is not None:
        raise ValueError("a critic LoRA (ppo.critic_lora) cannot train on a trajectory whose critic contexts "
                         "differ from the policy contexts (a non-chain team graph)")
    shapes = shapes or PrepareShapes()
    from_sampler = acfg.ppo.logp_old == "sampler" and traj.policy_logp is not None
    # Host: the feature pass's packing, then every trajectory array the device reads, uploaded once.
    stats = {"valid_tokens": 0, "unique_tokens": 0, "computed_tokens": 0}
    if with_critic:
        calls, gather, n_main, stats = feature_inputs(traj, token_level=acfg.algo.token_level,
                                                      tokens_per_call=acfg.tokens_per_call, policy=shapes.features,
                                                      placement=placement, share=acfg.share_prefixes)
    host = {"act_tokens": traj.act_tokens, "word_count": traj.word_count,
            "backup": backup_inputs(traj)}
    if from_sampler:
        host["logp"] = traj.policy_logp
    if keep_contexts:
        host |= {"ctx_tokens": traj.ctx_tokens, "ctx_valid": traj.ctx_valid}
    dev = _upload(placement, jax.tree.map(np.asarray, host))
    act_valid = dev["backup"].act_valid
    # Device: the recompute forward (its own program), then features, values and backups (one program).
    if not from_sampler:
        dev["logp"], entropy, st = recompute_logprobs(
            base, lora, traj, cfg=cfg, temperature=acfg.rollout.temperature, chunk=acfg.chunk,
            policy=shapes.logprobs, placement=placement, share=acfg.share_prefixes,
            actions=(dev["act_tokens"], act_valid))
        stats = {k: v + st[k] for k, v in stats.items()}
    if with_critic:
        out = _values_and_backups(base, critic, calls, gather, dev["backup"], cfg=cfg, acfg=acfg, n_main=n_main)
    else:
        out = _critic_free_backups(dev["backup"], acfg=acfg)
    batch = UpdateBatch(ctx_tokens=dev.get("ctx_tokens"), ctx_valid=dev.get("ctx_valid"),
                        act_tokens=dev["act_tokens"], act_valid=act_valid, logp_old=dev["logp"], adv=out.adv,
                        ret=out.ret if with_critic else None, v_old=out.value if with_critic else None,
                        dp_mask=out.dp, feats=out.feats, word_count=dev["word_count"])
    # Host: the metrics, from one transfer of the program's results.
    got = _host({"value": out.value, "ret": out.ret, "dp": out.dp, "placed": out.placed}
                | ({} if from_sampler else {"logp": dev["logp"], "entropy": entropy}))
    metrics = _prepare_metrics(got["value"] if with_critic else None, got["ret"], got["dp"], got["placed"],
                               got.get("logp"), np.asarray(traj.sample_logp), np.asarray(traj.act_valid),
                               np.asarray(traj.entropy) if from_sampler else got["entropy"])
    metrics["perf/tokens/prepare/valid"] = stats["valid_tokens"]
    metrics["perf/tokens/prepare/unique"] = stats["unique_tokens"]
    metrics["perf/tokens/prepare/computed"] = stats["computed_tokens"]
    return batch, metrics


def _prepare_metrics(value, ret, dp, placed, logp, sample_logp, act_valid, ent) -> dict:
    """Host metrics of the preparation; ``value`` None without a critic (no ``critic/*``)."""
    m = {}
    if logp is not None:  # recomputed: how far the sampler's log-probs are from the training forward's
        diff = np.abs(logp - sample_logp)[act_valid]
        m["rollout/logp_mismatch"] = float(diff.mean()) if diff.size else 0.0
    if value is not None:
        v, r = value[dp], ret[dp]
        var_r = float(np.var(r)) if r.size else 0.0
        ev = 1.0 - float(np.var(r - v)) / var_r if var_r > 1e-12 else 0.0
        m |= {"critic/explained_var": ev,
              "critic/value_mean": float(v.mean()) if v.size else 0.0,
              "critic/return_mean": float(r.mean()) if r.size else 0.0}
    return m | {
        "rollout/entropy": float(ent.reshape(act_valid.shape)[act_valid].mean()) if act_valid.any() else 0.0,
        "rewards/placed_sum_mean": float(placed.reshape(placed.shape[0], placed.shape[1], -1).sum((0, 2)).mean()),
    }
