"""Batched autoregressive sampling: a jitted prefill, then ``lax.while_loop`` decode phases.

The recipe (tunix): prompts are left-padded into length buckets (powers of two up to 256,
then multiples of 128 / quarter octaves, :func:`marft_jax.sampling.buckets.prompt_bucket`) and
power-of-two batch buckets; :func:`prefill` runs the prompt through the decoder (attending over
the prompt's own keys only) into a KV cache sized for the first decode phase, and picks the
first token; :func:`decode` continues in a ``lax.while_loop``. Parameters and the LoRA stack
are jit arguments, never closures; the adapter is picked inside jit by an agent index (a
scalar, or one index per row), so one compiled program serves every agent.

Decode phases (host loop in :class:`Sampler`, a few static shapes): the cache has exactly
``slots`` = the phase's bound, so every step attends over the filled part only, rounded up to
the bound (:func:`decode_phases`: ``prompt_bucket + n`` for a short geometric series of ``n``
ending at ``max_new_tokens``). A phase's loop exits when every row is done, the budget is
spent, the cache is full, or at most ``live_floor`` rows are still live. Between phases
:func:`resize` grows the cache to the next bound and compacts the batch: the live rows are
gathered into a smaller power-of-two batch (never below ``min_compact_batch``), so finished
rows stop costing work. Output buffers keep the ORIGINAL batch and are written by original row
id, and per-row randomness is keyed by that id, so compaction never changes a result. The
state is donated through every call, so the cache and buffers are updated in place; a step
writes only the new ``[layer, batch, kv_heads, 1, head_dim]`` cache entries.

Token choice per step (``z``: float32 logits of one row):

* ``temperature == 0``: greedy, ``argmax z`` (first index on ties, as PyTorch).
* otherwise ``z / T``, then optional top-k (keep the k largest), then optional top-p (keep the
  smallest set of most likely tokens whose probability reaches ``p``; the top token is always
  kept), then one inverse-CDF draw with a per-row uniform.
* the returned log-prob is ``log_softmax(z / T)[a]`` at the sampling temperature (``T = 1``
  when greedy), without top-k / top-p renormalisation (docs/algorithm.md#sampling-and-log-probs).
* next to it, the policy's own ``policy_logps = log_softmax(z / T_policy)[a]`` and full-vocabulary
  ``entropies = H(softmax(z / T_policy))`` (``T_policy`` traced, default 1): the quantities
  :func:`marft_jax.models.logprobs.action_logprobs` computes, so PPO can use them as its old
  log-probs without a recompute forward.

Randomness: the uniform of row ``r`` (its index in the caller's prompt list) at generated
position ``t`` comes from ``fold_in(fold_in(key, t), r)``, so a row's sample does not depend on
the batch size, on the other rows, on dummy rows added by batch bucketing, or on compaction.

Stopping: a row stops at the first token in its stop set (EOS, end-of-turn, ...); the stop token
is part of the action and counted in its length. Positions after a row's end hold ``pad_id``
and log-probs / entropy 0. ``finished`` is True for rows ended by a stop token, False for rows truncated
by the budget.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from typing import Any, Callable, Sequence

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from marft_jax.models import decoder
from marft_jax.models import lora as lora_lib
from marft_jax.models import sharding
from marft_jax.models.config import ModelConfig
from marft_jax.models.logprobs import logprob_and_entropy
from marft_jax.models.placement import Placement
from marft_jax.sampling import buckets
from marft_jax.sampling.prefix_reuse import PrefixKV, PrefixStore, StoredPrompts, gather_prefix, prefix_layout, prompt_slots

Params = dict[str, Any]
_TOP_K_MIN_BUCKET = 64  # top-k values up to this share one compiled program


# --------------------------------------------------------------------------- token choice


@flax.struct.dataclass
class SamplingParams:
    """Traced sampling controls (changing them does not recompile).

    temperature: float32 scalar, 0 = greedy. top_k: int32 scalar, 0 = off (needs the static
    ``top_k_max >= top_k``). top_p: float32 scalar in (0, 1], 1 = off (needs static
    ``use_top_p``). policy_temperature: float32 scalar > 0, the temperature of the returned
    ``policy_logps`` / ``entropies`` (the training policy's, independent of the sampling one).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    policy_temperature: jax.Array

    @classmethod
    def make(cls, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             policy_temperature: float = 1.0) -> "SamplingParams":
        cls.validate(temperature, top_k, top_p, policy_temperature)
        return cls(temperature=jnp.float32(temperature), top_k=jnp.int32(top_k), top_p=jnp.float32(top_p),
                   policy_temperature=jnp.float32(policy_temperature))

    @staticmethod
    def validate(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 policy_temperature: float = 1.0) -> None:
        """Range checks only (no arrays: safe at import time, before ``jax.distributed``)."""
        if temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {temperature}")
        if top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {top_k}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {top_p}")
        if not policy_temperature > 0:
            raise ValueError(f"policy_temperature must be > 0, got {policy_temperature}")


def top_k_bucket(top_k: int, vocab_size: int) -> int:
    """Static ``top_k_max`` for a top-k value: 0 when off, else a power of two >= 64, capped."""
    if top_k <= 0:
        return 0
    return min(max(_TOP_K_MIN_BUCKET, 1 << (int(top_k) - 1).bit_length()), vocab_size)


def greedy_argmax(logits: jax.Array) -> jax.Array:
    """``[batch, vocab] -> [batch]`` int32, the first index of the maximum (PyTorch's tie rule).

    Written as max + masked min: XLA:CPU runs this much faster than its variadic argmax.
    """
    vocab = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(logits == top, iota, vocab), axis=-1)


def _top_p_threshold(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """Exact nucleus threshold without a sort: the largest ``t`` with ``sum(p[p >= t]) >= top_p``.

    Bisection over the bit patterns of non-negative float32 values (their integer order is
    their float order), 31 masked sums. probs: ``[batch, vocab]`` -> ``[batch, 1]``.
    """
    as_int = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
    as_float = lambda i: jax.lax.bitcast_convert_type(i, jnp.float32)
    lo = jnp.zeros(probs.shape[:-1] + (1,), jnp.int32)                    # mass(p >= 0) = 1
    hi = as_int(jnp.max(probs, axis=-1, keepdims=True)) + 1               # mass(p >= hi) = 0

    def body(_, c):
        lo, hi = c
        mid = lo + (hi - lo) // 2
        mass = jnp.sum(jnp.where(probs >= as_float(mid), probs, 0.0), axis=-1, keepdims=True)
        ok = mass >= top_p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 31, body, (lo, hi))
    return as_float(lo)


def filter_logits(scaled: jax.Array, params: SamplingParams, *, top_k_max: int = 0,
                  use_top_p: bool = False) -> jax.Array:
    """Top-k then top-p masking of temperature-scaled logits (masked entries become -inf).

    scaled: ``[batch, vocab]`` float32 (``logits / T``). ``top_k_max``: static, 0 = top-k off;
    otherwise ``params.top_k`` (traced, ``1 <= top_k <= top_k_max`` or 0 = off) is applied via
    ``lax.top_k(scaled, top_k_max)``. ``use_top_p``: static switch for ``params.top_p``.
    """
    if top_k_max:
        # the barrier keeps XLA from folding a constant k's slice into the top-k, which then
        # runs as a sort of the whole vocabulary (XLA:CPU: 35 ms instead of 0.5 for [4, 49152])
        vals = jax.lax.optimization_barrier(jax.lax.top_k(scaled, top_k_max)[0])   # [batch, top_k_max] sorted
        k = jnp.clip(params.top_k, 1, top_k_max)
        kth = jax.lax.dynamic_index_in_dim(vals, k - 1, axis=-1, keepdims=True)
        kth = jnp.where(params.top_k > 0, kth, -jnp.inf)
        scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
    if use_top_p:
        probs = jax.nn.softmax(scaled, axis=-1)
        tau = _top_p_threshold(probs, params.top_p)
        scaled = jnp.where((probs >= tau) | (params.top_p >= 1.0), scaled, -jnp.inf)
    return scaled


def inverse_cdf_sample(weights: jax.Array, uniform: jax.Array, block: int = 256) -> jax.Array:
    """Draw one index per row with probability proportional to ``weights`` (>= 0).

    A two-level inverse CDF (block sums, then a cumulative sum inside the chosen block) needs
    one uniform per row instead of one per vocabulary entry. An entry of weight 0 is never
    drawn. weights: ``[batch, vocab]`` float32; uniform: ``[batch]`` in (0, 1]. -> ``[batch]``.
    """
    b, v = weights.shape
    nb = -(-v // block)
    w = jnp.pad(weights, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)
    bsum = jnp.sum(w, axis=-1)                                            # [b, nb]
    bcdf = jnp.cumsum(bsum, axis=-1)
    target = uniform * bcdf[:, -1]
    blk = jnp.minimum(jnp.sum(bcdf < target[:, None], axis=-1), nb - 1)   # bcdf[blk-1] < target <= bcdf[blk]
    before = jnp.where(blk > 0, jnp.take_along_axis(bcdf, jnp.maximum(blk - 1, 0)[:, None], 1)[:, 0], 0.0)
    inner = jnp.take_along_axis(w, blk[:, None, None], axis=1)[:, 0]      # [b, block]
    icdf = jnp.cumsum(inner, axis=-1)
    idx = jnp.sum(icdf < (target - before)[:, None], axis=-1)
    iota = jnp.arange(block)
    last_nonzero = jnp.max(jnp.where(inner > 0, iota, 0), axis=-1)       # guards rounding at the block end
    idx = jnp.minimum(idx, last_nonzero)
    return (blk * block + idx).astype(jnp.int32)


def row_uniforms(key: jax.Array, step: jax.Array, row_ids: jax.Array) -> jax.Array:
    """``[batch]`` uniforms in (0, 1], row ``r`` from ``fold_in(fold_in(key, step), r)``."""
    step_key = jax.random.fold_in(key, step)
    draw = lambda r: jax.random.uniform(jax.random.fold_in(step_key, r), (), jnp.float32)
    return 1.0 - jax.vmap(draw)(row_ids)


def choose_tokens(logits: jax.Array, uniform: jax.Array, params: SamplingParams, *,
                  top_k_max: int = 0, use_top_p: bool = False) -> tuple[jax.Array, jax.Array]:
    """Pick one token per row and its log-prob at the sampling temperature.

    logits: ``[batch, vocab]`` float32; uniform: ``[batch]`` in (0, 1].
    Returns ``(tokens [batch] int32, logp [batch] float32)`` with
    ``logp = log_softmax(logits / T)[token]`` (``T = 1`` when greedy).
    """
    chex.assert_rank(logits, 2)
    logits = logits.astype(jnp.float32)
    greedy = params.temperature <= 0.0
    temp = jnp.where(greedy, 1.0, params.temperature)
    scaled = logits / temp
    logp_all = jax.nn.log_softmax(scaled, axis=-1)

    def sample(_):
        if top_k_max or use_top_p:
            kept = filter_logits(scaled, params, top_k_max=top_k_max, use_top_p=use_top_p)
            weights = jnp.exp(kept - jnp.max(kept, axis=-1, keepdims=True))
        else:
            weights = jnp.exp(logp_all)
        return inverse_cdf_sample(weights, uniform)

    tokens = jax.lax.cond(greedy, lambda _: greedy_argmax(logits), sample, None)
    logp = jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
    return tokens, logp


def policy_scores(logits: jax.Array, tokens: jax.Array, policy_temperature: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """The policy's log-prob of ``tokens`` and its entropy, over the full vocabulary.

    logits: ``[batch, vocab]`` float32; tokens: ``[batch]`` int32; policy_temperature: float32
    scalar ``T > 0``. Returns ``(logp, entropy)`` ``[batch]`` float32 with ``z = logits / T``:
    ``logp = z[token] - logsumexp(z)``, ``entropy = logsumexp(z) - sum(softmax(z) * z)``: the
    training forward's own :func:`marft_jax.models.logprobs.logprob_and_entropy`.
    """
    z = logits.astype(jnp.float32) * (1.0 / jnp.asarray(policy_temperature, jnp.float32))
    return logprob_and_entropy(z, tokens)


# --------------------------------------------------------------------------- state


@flax.struct.dataclass
class SamplerState:
    """Everything the decode loop carries (donated between calls).

    Working rows (``batch``: the current batch bucket, smaller than the original after
    compaction):

    cache: the KV cache, ``slots`` = the current phase's bound.
    last: ``[batch]`` int32, the token to feed next; positions: ``[batch]`` int32, its RoPE
    position (``_advance`` moves both on together). done: ``[batch]`` bool, ended for any reason.
    agent: int32 scalar or ``[batch]``; stop_ids: ``[batch, num_stop]`` int32 (-1 = unused slot).
    row_ids: ``[batch]`` int32, the row's index in the original batch (output row, randomness);
    padding rows added by compaction hold ``rows`` (out of range: they write nothing).

    Output buffers (``rows``: the original batch bucket, indexed by row id):

    tokens: ``[rows, max_new]`` int32; logps / policy_logps / entropies: ``[rows, max_new]``
    float32; lengths: ``[rows]`` int32 generated tokens so far (stop token included);
    finished: ``[rows]`` bool, ended by a stop token.

    step: int32 scalar, generated positions so far; budget: int32 scalar, at most max_new;
    key: PRNG key; pad_id: int32 scalar; sampling: traced :class:`SamplingParams`.
    """

    cache: decoder.KVCache
    tokens: jax.Array
    logps: jax.Array
    policy_logps: jax.Array
    entropies: jax.Array
    last: jax.Array
    positions: jax.Array
    done: jax.Array
    finished: jax.Array
    lengths: jax.Array
    step: jax.Array
    budget: jax.Array
    agent: jax.Array
    stop_ids: jax.Array
    row_ids: jax.Array
    key: jax.Array
    pad_id: jax.Array
    sampling: SamplingParams


@flax.struct.dataclass
class SampleResult:
    """Generated actions (device arrays; :class:`Sampler` returns NumPy ones).

    tokens: ``[batch, max_new]`` int32, ``pad_id`` after each row's end.
    lengths: ``[batch]`` int32, generated tokens, the stop token included.
    logps: ``[batch, max_new]`` float32, ``log_softmax(z / T)[token]`` at the sampling
      temperature (``T = 1`` when greedy), 0 after the end.
    finished: ``[batch]`` bool, True when the row ended with a stop token (False: truncated).
    steps: int32 scalar, generated positions the batch ran (loop iterations + 1 for prefill).
    policy_logps: ``[batch, max_new]`` float32, ``log_softmax(z / T_policy)[token]`` over the
      full vocabulary (no top-k / top-p renormalisation), 0 after the end.
    entropies: ``[batch, max_new]`` float32, entropy of ``softmax(z / T_policy)``, 0 after the end.
    """

    tokens: Any
    lengths: Any
    logps: Any
    finished: Any
    steps: Any
    policy_logps: Any = None
    entropies: Any = None


def _advance(s: SamplerState, cache: decoder.KVCache, tok: jax.Array, logp: jax.Array,
             policy_logp: jax.Array, entropy: jax.Array) -> SamplerState:
    """Write the tokens chosen at position ``s.step`` (by original row id) and update stopping."""
    live = ~s.done
    dest = jnp.where(live, s.row_ids, s.tokens.shape[0])     # done / padding rows: dropped
    col = s.step
    put = lambda buf, val: buf.at[dest, col].set(val, mode="drop")
    hit_stop = jnp.any(tok[:, None] == s.stop_ids, axis=-1) & live
    return s.replace(
        cache=cache, tokens=put(s.tokens, tok), logps=put(s.logps, logp),
        policy_logps=put(s.policy_logps, policy_logp), entropies=put(s.entropies, entropy),
        last=jnp.where(live, tok, s.pad_id), positions=s.positions + 1,
        done=s.done | hit_stop, finished=s.finished.at[dest].set(hit_stop, mode="drop"),
        lengths=s.lengths.at[dest].add(1, mode="drop"), step=s.step + 1)


def _pick_and_advance(s: SamplerState, cache: decoder.KVCache, logits: jax.Array, top_k_max: int,
                      use_top_p: bool) -> SamplerState:
    u = row_uniforms(s.key, s.step, s.row_ids)
    tok, logp = choose_tokens(logits, u, s.sampling, top_k_max=top_k_max, use_top_p=use_top_p)
    policy_logp, entropy = policy_scores(logits, tok, s.sampling.policy_temperature)
    return _advance(s, cache, tok, logp, policy_logp, entropy)


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "top_k_max", "use_top_p", "slots", "whole_len"))
@jax.named_scope("rollout/prefill")
def prefill(
    params: Params,
    lora: lora_lib.LoraStack | None,
    tokens: jax.Array,
    valid: jax.Array,
    active: jax.Array,
    agent: jax.Array,
    stop_ids: jax.Array,
    key: jax.Array,
    sampling: SamplingParams,
    budget: jax.Array,
    pad_id: jax.Array,
    *,
    cfg: ModelConfig,
    max_new_tokens: int,
    top_k_max: int = 0,
    use_top_p: bool = False,
    slots: int | None = None,
    prefix: PrefixKV | None = None,
    whole_len: int | None = None,
) -> SamplerState:
    """Run the prompts, fill a fresh KV cache and choose the first generated token.

    Args:
      params, lora: base weights and optional adapter stack (``agent`` selects the adapter).
      tokens, valid: ``[batch, prompt_bucket]`` int32 / bool, left-padded; every row has at
        least one valid token (its last position).
      active: ``[batch]`` bool, False for dummy rows (they start done and are never counted).
      agent: int32 scalar or ``[batch]``.
      stop_ids: ``[num_stop]`` or ``[batch, num_stop]`` int32 stop token ids (-1 = unused).
      key: PRNG key; sampling: traced temperatures / top-k / top-p.
      budget: int32 scalar, tokens to generate at most (clipped to ``[1, max_new_tokens]``).
      pad_id: int32 scalar written after each row's end.
      max_new_tokens: static, the size of the output buffers.
      slots: static cache size (default ``prompt bucket + max_new_tokens``: one decode phase to
        the end); the prompt attends over its own keys (and the reused prefix) only, never over
        the empty slots.
      prefix: reused prompt prefixes (:mod:`marft_jax.sampling.prefix_reuse`): ``tokens`` are
        then the rest of each prompt, which attends to the ``P`` prefix slots; positions continue
        from ``prefix.lengths``. The cache is then compacted to ``whole_len`` slots (static, at
        least every row's prefix + rest): each row's whole prompt right-aligned, as a prefill
        of the whole prompts would leave it, so the decode steps read no gap between the two.
        None: ``tokens`` are whole prompts.
    Returns the :class:`SamplerState` after one generated position.
    """
    chex.assert_rank([tokens, valid, active], [2, 2, 1])
    b, length = tokens.shape
    reused = 0 if prefix is None else prefix.k.shape[3]
    if prefix is not None and whole_len is None:
        raise ValueError("prefill: a reused prefix needs whole_len (the compacted prompt bucket)")
    prompt_len = length if prefix is None else int(whole_len)
    slots = prompt_len + max_new_tokens if slots is None else int(slots)
    if slots < prompt_len:
        raise ValueError(f"prefill: slots={slots} < prompt bucket {prompt_len}")
    stop_ids = jnp.asarray(stop_ids, jnp.int32)
    if stop_ids.ndim == 1:
        stop_ids = jnp.broadcast_to(stop_ids[None], (b, stop_ids.shape[0]))
    chex.assert_rank(stop_ids, 2)
    agent = jnp.asarray(agent, jnp.int32)
    dtype = params["embed"].dtype
    positions = decoder.position_ids(valid)
    if prefix is None:
        cache = decoder.KVCache.init(cfg, b, slots, dtype=dtype)
        start = jnp.zeros((b,), jnp.int32)
    else:
        grow = ((0, 0), (0, 0), (0, 0), (0, length), (0, 0))
        cache = decoder.KVCache(k=jnp.pad(prefix.k.astype(dtype), grow), v=jnp.pad(prefix.v.astype(dtype), grow),
                                valid=jnp.pad(prefix.valid, ((0, 0), (0, length))),
                                index=jnp.asarray(reused, jnp.int32))
        start = prefix.lengths.astype(jnp.int32)
        positions = positions + start[:, None]
    hidden, cache = decoder.forward(params, tokens, valid, cfg=cfg, positions=positions, lora=lora,
                                    agent=agent if lora is not None else None, cache=cache, read_slots=reused)
    if prefix is not None:
        cache = _compact_prompts(cache, start, jnp.sum(valid, axis=-1, dtype=jnp.int32), reused, prompt_len, slots)
    logits = decoder.logits_from_hidden(params, cfg, hidden[:, -1])
    out_f32 = jnp.zeros((b, max_new_tokens), jnp.float32)
    state = SamplerState(
        cache=cache,
        tokens=jnp.full((b, max_new_tokens), pad_id, jnp.int32),
        logps=out_f32, policy_logps=out_f32, entropies=out_f32,
        last=jnp.zeros((b,), jnp.int32),
        positions=start + jnp.sum(valid, axis=-1, dtype=jnp.int32) - 1,   # of the last prompt token
        done=~active, finished=jnp.zeros((b,), bool), lengths=jnp.zeros((b,), jnp.int32),
        step=jnp.zeros((), jnp.int32),
        budget=jnp.clip(jnp.asarray(budget, jnp.int32), 1, max_new_tokens),
        agent=agent, stop_ids=stop_ids, row_ids=jnp.arange(b, dtype=jnp.int32), key=key,
        pad_id=jnp.asarray(pad_id, jnp.int32), sampling=sampling)
    return _pick_and_advance(state, cache, logits, top_k_max, use_top_p)


def _compact_prompts(cache: decoder.KVCache, reused_len: jax.Array, rest_len: jax.Array, reused: int,
                     whole: int, slots: int) -> decoder.KVCache:
    """A prefill-after-prefix cache (``reused`` prefix slots, row ``r``'s ``reused_len[r]``
    right-aligned, then the rest's bucket with its ``rest_len[r]`` tokens right-aligned) as
    ``slots`` slots whose first ``whole`` hold each row's whole prompt right-aligned."""
    rest = cache.k.shape[3] - reused
    total = (reused_len + rest_len)[:, None]
    off = jnp.arange(whole, dtype=jnp.int32)[None, :] - (whole - total)             # [b, whole]
    src = jnp.where(off < reused_len[:, None], reused - reused_len[:, None] + off,
                    reused + rest - rest_len[:, None] + off - reused_len[:, None])
    ok = off >= 0
    src = jnp.where(ok, src, 0)
    grow = ((0, 0), (0, 0), (0, 0), (0, slots - whole), (0, 0))
    take = lambda x: jnp.pad(jnp.take_along_axis(x, src[None, :, None, :, None], axis=3), grow)
    return decoder.KVCache(k=take(cache.k), v=take(cache.v), valid=jnp.pad(ok, ((0, 0), (0, slots - whole))),
                           index=jnp.asarray(whole, jnp.int32))


@functools.partial(jax.jit, static_argnames=("cfg", "top_k_max", "use_top_p"), donate_argnums=(2,))
@jax.named_scope("rollout/decode")
def decode(params: Params, lora: lora_lib.LoraStack | None, state: SamplerState,
           live_floor: jax.Array | int = -1, *, cfg: ModelConfig, top_k_max: int = 0,
           use_top_p: bool = False) -> SamplerState:
    """Decode one phase: until every row is done, ``state.budget`` positions are generated, the
    cache is full, or at most ``live_floor`` rows (int32, traced; < 1 = off) are still live.

    Each step attends over all ``slots`` of the cache (the phase bound) plus the new token and
    writes only the new entries. ``state`` is donated: its cache and buffers are reused in
    place; never read it afterwards.
    """
    ones = jnp.ones((state.last.shape[0], 1), bool)
    use_lora = lora is not None
    slots = state.cache.k.shape[3]
    floor = jnp.maximum(jnp.asarray(live_floor, jnp.int32), 0)

    def keep_going(s: SamplerState) -> jax.Array:
        live = jnp.sum(~s.done, dtype=jnp.int32)
        return (s.step < s.budget) & (live > floor) & (s.cache.index < slots)

    def step(s: SamplerState) -> SamplerState:
        hidden, cache = decoder.forward(params, s.last[:, None], ones, cfg=cfg,
                                        positions=s.positions[:, None], lora=lora,
                                        agent=s.agent if use_lora else None, cache=s.cache)
        logits = decoder.logits_from_hidden(params, cfg, hidden[:, 0])
        return _pick_and_advance(s, cache, logits, top_k_max, use_top_p)

    return jax.lax.while_loop(keep_going, step, state)


@functools.partial(jax.jit, static_argnames=("slots", "compact"), donate_argnums=(0,))
def resize(state: SamplerState, rows: jax.Array, keep: jax.Array, *, slots: int, compact: bool = True) -> SamplerState:
    """Compact the working batch and/or grow the cache between decode phases.

    rows: ``[new_batch]`` int32 working-row indices to gather; keep: ``[new_batch]`` bool, False
    for padding rows (they become done, with an out-of-range row id, and write nothing).
    slots: static new cache size (>= the current one; the new slots are empty). The output
    buffers (original rows) pass through untouched. ``state`` is donated.

    Under a context mesh the working rows stay split over the row shards (a gather with a
    replicated index would otherwise return the cache whole on every device, and the next
    decode phase would compute every row on every device).

    compact: False when ``rows`` is every working row in order and ``keep`` all True (the cache
    only grows): the rows are not gathered at all, so each device pads its own rows in place
    (the gather all-gathers the cache on a mesh, even for the identity).
    """
    old = state.cache.k.shape[3]
    if slots < old:
        raise ValueError(f"resize: slots={slots} < current {old}")
    grow = ((0, 0), (0, 0), (0, 0), (0, slots - old), (0, 0))
    split = functools.partial(sharding.constrain_rows, keep_other_axes=True)
    if not compact:
        return state.replace(cache=decoder.KVCache(
            k=split(jnp.pad(state.cache.k, grow), 1), v=split(jnp.pad(state.cache.v, grow), 1),
            valid=jnp.pad(state.cache.valid, ((0, 0), (0, slots - old))), index=state.cache.index))
    take = lambda x: split(jnp.take(x, rows, axis=0))
    cache = decoder.KVCache(
        k=split(jnp.pad(jnp.take(state.cache.k, rows, axis=1), grow), 1),
        v=split(jnp.pad(jnp.take(state.cache.v, rows, axis=1), grow), 1),
        valid=jnp.pad(take(state.cache.valid), ((0, 0), (0, slots - old))),
        index=state.cache.index)
    return state.replace(
        cache=cache, last=take(state.last), positions=take(state.positions),
        done=jnp.where(keep, take(state.done), True),
        agent=take(state.agent) if state.agent.ndim else state.agent,
        stop_ids=take(state.stop_ids),
        row_ids=jnp.where(keep, take(state.row_ids), state.tokens.shape[0]))


def result_of(state: SamplerState) -> SampleResult:
    """The :class:`SampleResult` view of a final state (device arrays, original rows)."""
    return SampleResult(tokens=state.tokens, lengths=state.lengths, logps=state.logps,
                        finished=state.finished, steps=state.step,
                        policy_logps=state.policy_logps, entropies=state.entropies)


def decode_phases(prompt_len: int, max_new: int, *, first: int = 32, growth: float = 1.25) -> tuple[int, ...]:
    """Static new-token bounds of the decode phases: phase ``i`` caches ``prompt_len + n_i`` slots.

    Candidates are ``first · 2^k < max_new`` and ``max_new`` itself (always the last); a
    candidate is kept only when the next kept bound's cache is more than ``growth`` times
    larger, so long prompts (where the generated part is a small share of the keys) run in
    one or two phases and short ones in a few. Deterministic in its arguments: a run reuses
    the same compiled shapes.
    """
    if max_new < 1:
        raise ValueError(f"max_new must be >= 1, got {max_new}")
    cands, n = [], first
    while n < max_new:
        cands.append(n)
        n *= 2
    kept = [max_new]
    for n in reversed(cands):
        if prompt_len + kept[0] > growth * (prompt_len + n):
            kept.insert(0, n)
    return tuple(kept)


# --------------------------------------------------------------------------- host API


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """User-facing sampling settings (docs/algorithm.md#sampling-and-log-probs: training T=1, eval T=0.6)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        SamplingParams.validate(self.temperature, self.top_k, self.top_p)


def stop_id_array(ids: Sequence[int], minimum: int = 8) -> np.ndarray:
    """Stop ids padded with -1 to a power-of-two size (>= ``minimum``): ``[num_stop]`` int32."""
    size = buckets.length_bucket(len(ids), minimum=minimum)
    out = np.full((size,), -1, np.int32)
    out[:len(ids)] = np.asarray(ids, np.int32)
    return out


def device_bytes(x) -> int:
    """Bytes of ``x`` summed over the devices that hold it: one shard's bytes times the devices
    of its sharding (a replicated array counts once per device, an array split over the devices
    once in all; ``nbytes`` on one device or for a host array)."""
    sh = getattr(x, "sharding", None)
    if sh is None:
        return int(x.nbytes)
    return int(math.prod(sh.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize * len(sh.device_set))


def decode_weight_bytes(params: Params, lora, cfg: ModelConfig) -> int:
    """Bytes of weights one decode step reads (:func:`device_bytes`): the LoRA stack and the
    base, where a projection or LM head that reads GGUF blocks (``cfg.decode_weights ==
    "native"``, :data:`decoder.QUANTIZED` in ``params``) counts its blocks instead of its float
    weights. The embedding's gather is counted whole unless the tied LM head reads blocks."""
    quantized = params.get(decoder.QUANTIZED) if cfg.decode_weights == "native" else None
    if not quantized:
        return sum(device_bytes(x) for x in jax.tree.leaves((params, lora)))
    layers = quantized.get("layers", {})
    base = {k: v for k, v in params.items() if k != decoder.QUANTIZED}
    base["layers"] = {n: ({k: w for k, w in sub.items() if k != "kernel"} if n in layers else sub)
                      for n, sub in base["layers"].items()}
    if "lm_head" in quantized:
        base.pop("lm_head" if "lm_head" in base else "embed")
    return sum(device_bytes(x) for x in jax.tree.leaves((base, quantized, lora)))


@dataclasses.dataclass
class SamplerTotals:
    """Work and time of the sampler calls since the last :meth:`Sampler.take_totals` (host
    wall-clock, after each stage's results are ready).

    prefill_s / decode_s: seconds; prefill_slots: rows × prompt bucket over the prefills;
    decode_row_steps: rows × decode steps (compacted batches count their own rows);
    decode_bytes: bytes a decode step must read, summed over steps: the weights (base + LoRA)
    plus the K/V cache slots attention reads (the floor of HBM traffic; ``perf/hbm_bw_util``),
    summed over the devices that hold them (:func:`device_bytes`: on a mesh, replicated weights
    count once per device, split rows of the cache once in all); prefill_reused: prompt tokens
    whose K/V came from an earlier call (:mod:`marft_jax.sampling.prefix_reuse`), not computed.
    """

    calls: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_slots: int = 0
    decode_row_steps: int = 0
    decode_bytes: float = 0.0
    prefill_reused: int = 0


@dataclasses.dataclass(frozen=True)
class PrefillCall:
    """One sampler call's padded ``batch``, :func:`prefill`'s ``args`` after the weights and
    ``kwargs``, the ``static`` arguments :func:`decode` shares, the decode ``phases`` and the
    token ``limit``."""

    batch: buckets.PaddedBatch
    args: tuple
    kwargs: dict
    static: dict
    phases: tuple[int, ...]
    limit: int


class Sampler:
    """Host-side entry point: token-id lists in, NumPy results out (trimmed to the real rows).

    Prompts are bucketed (length: :func:`marft_jax.sampling.buckets.prompt_bucket`, powers of
    two >= ``min_prompt_bucket`` up to ``fine_above``, then multiples of 128 / quarter octaves;
    batch: powers of two >= ``min_batch``) and decoding runs in a few static phases
    (:func:`decode_phases`), so a run compiles a handful of programs. Between phases (and when
    at most half the rows are live) the live rows are compacted into a smaller power-of-two
    batch, never below ``min_compact_batch`` (small batches are bound by the weights, not the
    rows, and each new batch size is a compile).

    Example::

        sampler = Sampler(cfg, pad_id=tok.pad_token_id, stop_ids=[eos, end_of_turn])
        out = sampler(params, prompts, key=jax.random.key(0),
                      config=SamplingConfig(max_new_tokens=128, temperature=1.0),
                      lora=stack, agent=1)
        out.tokens[i, :out.lengths[i]]    # row i's action, stop token included
    """

    def __init__(self, cfg: ModelConfig, *, pad_id: int = 0, stop_ids: Sequence[int] = (),
                 min_prompt_bucket: int = 16, max_prompt_len: int | None = None,
                 min_batch: int = 1, max_batch: int | None = None,
                 fine_above: int | None = 256, min_compact_batch: int = 8, quantized: dict | None = None):
        if cfg.decode_weights == "native" and not quantized:
            raise ValueError("Sampler: cfg.decode_weights is 'native' but no quantized blocks were given "
                             "(gguf_loader.quantized_blocks)")
        self.cfg = cfg
        # GGUF blocks for the decode steps' native matvec (model.decode_weights=native), on device
        self.quantized = (jax.tree.map(jnp.asarray, quantized)
                          if quantized and cfg.decode_weights == "native" else None)
        self.pad_id = int(pad_id)
        self.stop_ids = tuple(int(i) for i in stop_ids)
        self.min_prompt_bucket = min_prompt_bucket
        self.max_prompt_len = max_prompt_len
        self.min_batch = min_batch
        self.max_batch = max_batch
        self.fine_above = fine_above
        if min_compact_batch < 1:
            raise ValueError(f"min_compact_batch must be >= 1, got {min_compact_batch}")
        self.min_compact_batch = int(min_compact_batch)
        self.totals = SamplerTotals()
        # The run's placement (marft_jax.models.placement): prompt rows, and so the KV cache, are
        # split over its row shards (place_on); until then this process's first device.
        self.placement = Placement.single()

    def place_on(self, placement: Placement) -> None:
        """Split the batch of every call over ``placement``'s row shards (a batch bucket the
        shards do not divide stays replicated). Compaction never goes below the shard count."""
        self.placement = placement
        self.min_batch = max(self.min_batch, placement.row_shards)
        self.min_compact_batch = max(self.min_compact_batch, placement.row_shards)

    def with_quantized(self, params: Params) -> Params:
        """``params`` with the GGUF blocks under :data:`decoder.QUANTIZED` when the decode steps
        read them (``cfg.decode_weights == "native"``), else ``params``."""
        if self.quantized is None:
            return params
        return {**params, decoder.QUANTIZED: self.quantized}

    def _mesh_context(self):
        """The placement's mesh as JAX's context mesh (where :func:`resize` keeps rows split)."""
        return jax.set_mesh(self.placement.mesh)

    def _host(self, tree):
        return sharding.to_host(tree)

    def _rows(self, x: np.ndarray) -> jax.Array:
        return self.placement.rows(x, 0)

    def take_totals(self) -> SamplerTotals:
        """The :class:`SamplerTotals` since the last call, and start counting afresh."""
        out, self.totals = self.totals, SamplerTotals()
        return out

    def prefill_call(self, prompts: Sequence[Sequence[int]], *, key: jax.Array,
                     config: SamplingConfig = SamplingConfig(), lora: lora_lib.LoraStack | None = None,
                     agent: int | Sequence[int] = 0, stop_ids: Sequence[int] | None = None,
                     budget: int | None = None, policy_temperature: float = 1.0,
                     rows: Callable[[np.ndarray], Any] | None = None, whole_len: int | None = None) -> "PrefillCall":
        """The padded batch and :func:`prefill`'s arguments after the weights for one call
        (arguments as :meth:`__call__`). ``rows`` places a row-major array (default: the
        sampler's row split; ``marft-jax preflight`` passes abstract placed shapes).
        ``whole_len``: ``prompts`` are the rest of prompts whose reused prefix the call adds
        (:mod:`marft_jax.sampling.prefix_reuse`); the cache then holds the whole prompts'
        bucket ``whole_len``."""
        rows = rows or self._rows
        batch = buckets.pad_prompts(prompts, pad_id=self.pad_id, min_length=self.min_prompt_bucket,
                                    max_length=self.max_prompt_len, min_batch=self.min_batch,
                                    max_batch=self.max_batch, fine_above=self.fine_above)
        n, b = batch.num_real, batch.tokens.shape[0]
        length = batch.tokens.shape[1]
        if np.ndim(agent) == 0:
            agent_arr = jnp.int32(agent)
        else:
            if len(agent) != n:
                raise ValueError(f"agent has {len(agent)} entries for {n} prompts")
            agent_arr = rows(np.pad(np.asarray(agent, np.int32), (0, b - n)))
        if lora is None:
            agent_arr = jnp.int32(0)
        ids = self.stop_ids if stop_ids is None else tuple(int(i) for i in stop_ids)
        sampling = SamplingParams.make(config.temperature, config.top_k, config.top_p,
                                       policy_temperature=policy_temperature)
        max_new = config.max_new_tokens
        limit = int(np.clip(max_new if budget is None else budget, 1, max_new))
        cache_len = length if whole_len is None else int(whole_len)
        phases = decode_phases(cache_len, max_new)
        static = dict(cfg=self.cfg, top_k_max=top_k_bucket(config.top_k, self.cfg.vocab_size),
                      use_top_p=config.top_p < 1.0)
        args = (rows(batch.tokens), rows(batch.valid), rows(batch.active), agent_arr,
                jnp.asarray(stop_id_array(ids)), key, sampling, jnp.int32(limit), jnp.int32(self.pad_id))
        return PrefillCall(batch=batch, args=args, kwargs=dict(static, max_new_tokens=max_new,
                                                               slots=cache_len + phases[0]),
                           static=static, phases=phases, limit=limit)

    def __call__(
        self,
        params: Params,
        prompts: Sequence[Sequence[int]],
        *,
        key: jax.Array,
        config: SamplingConfig = SamplingConfig(),
        lora: lora_lib.LoraStack | None = None,
        agent: int | Sequence[int] = 0,
        stop_ids: Sequence[int] | None = None,
        budget: int | None = None,
        policy_temperature: float = 1.0,
        prefix: PrefixStore | None = None,
    ) -> SampleResult:
        """Sample one response per prompt.

        Args:
          params: base weights; prompts: token-id lists (non-empty).
          key: PRNG key; identical key and inputs give identical samples.
          config: max_new_tokens (static: buffer size), temperature / top-k / top-p (traced).
          lora, agent: adapter stack and agent index (one int, or one per prompt).
          stop_ids: overrides the sampler's stop set for this call.
          budget: generate at most this many tokens (<= max_new_tokens; traced, no recompile).
          policy_temperature: temperature of the returned ``policy_logps`` / ``entropies``
            (traced, > 0).
          prefix: reuse the K/V of prompt prefixes this store holds from earlier calls with the
            same weights, and keep this call's prompt K/V in it
            (:mod:`marft_jax.sampling.prefix_reuse`); None: every prompt is prefilled whole.
        Returns a :class:`SampleResult` of NumPy arrays with ``len(prompts)`` rows.
        """
        agents = [int(agent)] * len(prompts) if np.ndim(agent) == 0 else [int(a) for a in agent]
        match = prefix.match(prompts, agents) if prefix is not None else None
        whole, whole_len = prompts, None
        if match is not None:
            whole_len = self.length_bucket(max(len(p) for p in prompts))
            prompts = [p[int(m):] for p, m in zip(prompts, match.lengths)]
        call = self.prefill_call(prompts, key=key, config=config, lora=lora, agent=agent, stop_ids=stop_ids,
                                 budget=budget, policy_temperature=policy_temperature, whole_len=whole_len)
        params = self.with_quantized(params)
        batch, phases, limit = call.batch, call.phases, call.limit
        n, (b, length) = batch.num_real, batch.tokens.shape
        cache_len = length if whole_len is None else whole_len
        top_k_max, use_top_p = call.static["top_k_max"], call.static["use_top_p"]
        t0 = time.perf_counter()
        # Under the run's context mesh the decoder keeps the rows split (with mesh.fsdp: each
        # layer's weights gathered, not every row's partial sums all-reduced).
        with jax.profiler.TraceAnnotation("sampler/prefill"), self._mesh_context():
            kwargs = call.kwargs
            if match is not None:
                entry = prefix.entries[prefix.key(agents)]
                plan = prefix_layout(match, entry, b, self.length_bucket(int(match.lengths.max())))
                kwargs = dict(kwargs, prefix=gather_prefix(entry.k, entry.v, *map(self._rows, plan)),
                              whole_len=whole_len)
                prefix.reused_tokens += match.reused
                self.totals.prefill_reused += match.reused
            state = prefill(params, lora, *call.args, **kwargs)
            if prefix is not None:       # each row's whole prompt, right-aligned in the first cache_len slots
                k, v = prompt_slots(state.cache.k, state.cache.v, length=cache_len)
                prefix.put(agents, StoredPrompts(k=k, v=v, tokens=[np.asarray(p, np.int64) for p in whole],
                                                 agents=np.asarray(agents, np.int64)))
            jax.block_until_ready(state.last)
        t1 = time.perf_counter()
        weight_bytes = decode_weight_bytes(params, lora, self.cfg)
        with jax.profiler.TraceAnnotation("sampler/decode"), self._mesh_context():
            state = self._decode_phases(params, lora, state, cache_len, phases, limit, top_k_max, use_top_p,
                                        weight_bytes)
            res = self._host(result_of(state))
        tot = self.totals
        tot.calls += 1
        tot.prefill_s += t1 - t0
        tot.decode_s += time.perf_counter() - t1
        tot.prefill_slots += b * length
        return SampleResult(tokens=res.tokens[:n], lengths=res.lengths[:n], logps=res.logps[:n],
                            finished=res.finished[:n], steps=int(res.steps),
                            policy_logps=res.policy_logps[:n], entropies=res.entropies[:n])

    def length_bucket(self, n: int) -> int:
        """The prompt length bucket of ``n`` tokens (as :func:`buckets.pad_prompts` pads them)."""
        return buckets.prompt_bucket(n, minimum=self.min_prompt_bucket, maximum=self.max_prompt_len,
                                     fine_above=self.fine_above)

    def _decode_phases(self, params, lora, state: SamplerState, length: int, phases: tuple[int, ...],
                       limit: int, top_k_max: int, use_top_p: bool, weight_bytes: int = 0) -> SamplerState:
        """Host loop over decode phases; compacts finished rows away and grows the cache."""
        if limit <= 1:                              # prefill chose the only token
            return state
        phase = 0
        step = int(state.step)
        while True:
            rows = state.last.shape[0]
            half = rows // 2
            floor = half if half >= self.min_compact_batch else -1
            before = step
            state = decode(params, lora, state, jnp.int32(floor), cfg=self.cfg, top_k_max=top_k_max,
                           use_top_p=use_top_p)
            step, done, index = (int(x) if np.ndim(x) == 0 else x
                                 for x in self._host((state.step, state.done, state.cache.index)))
            cache = state.cache
            self.totals.decode_row_steps += rows * (step - before)
            self.totals.decode_bytes += (step - before) * (weight_bytes + device_bytes(cache.k)
                                                           + device_bytes(cache.v))
            live = np.nonzero(~done)[0]
            if step >= limit or live.size == 0:
                return state
            slots = state.cache.k.shape[3]
            if index >= slots:                      # phase bound reached: next bound
                phase += 1
                if phase >= len(phases):
                    raise RuntimeError(f"sampler: cache full at {slots} slots before the budget")
                slots = length + phases[phase]
            new_rows = rows
            if live.size <= half and half >= self.min_compact_batch:
                new_rows = max(buckets.batch_bucket(live.size), self.min_compact_batch)
            if new_rows == rows and slots == state.cache.k.shape[3]:
                raise RuntimeError("sampler: decode phase ended without progress")
            if new_rows < rows:
                gather = np.concatenate([live, np.full(new_rows - live.size, live[0])]).astype(np.int32)
                keep = np.arange(new_rows) < live.size
            else:
                gather, keep = np.arange(rows, dtype=np.int32), np.ones(rows, bool)
            with warnings.catch_warnings():     # a resized cache cannot reuse the donated one
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                state = resize(state, jnp.asarray(gather), jnp.asarray(keep), slots=slots,
                               compact=new_rows < rows)
