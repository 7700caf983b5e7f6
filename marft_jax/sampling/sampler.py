"""Batched autoregressive sampling: a jitted prefill, then a ``lax.while_loop`` decode.

The recipe (tunix): prompts are left-padded into power-of-two buckets
(:mod:`marft_jax.sampling.buckets`); :func:`prefill` runs the prompt through the decoder,
filling a preallocated KV cache of ``prompt_bucket + max_new_tokens`` slots, and picks the
first token; :func:`decode` continues in a ``lax.while_loop`` that exits as soon as every row
has emitted a stop token or the token budget is spent. The sampler state (cache included) is
donated from one call to the next, so the cache is updated in place. Parameters and the LoRA
stack are jit arguments, never closures; the adapter is picked inside jit by an agent index
(a scalar, or one index per row), so one compiled program serves every agent.

Token choice per step (``z``: float32 logits of one row):

* ``temperature == 0``: greedy, ``argmax z`` (first index on ties, as PyTorch).
* otherwise ``z / T``, then optional top-k (keep the k largest), then optional top-p (keep the
  smallest set of most likely tokens whose probability reaches ``p``; the top token is always
  kept), then one inverse-CDF draw with a per-row uniform.
* the returned log-prob is ``log_softmax(z / T)[a]`` at the sampling temperature (``T = 1``
  when greedy), without top-k / top-p renormalisation (MARFT reference §3).

Randomness: the uniform of row ``r`` at generated position ``t`` comes from
``fold_in(fold_in(key, t), r)``, so a row's sample does not depend on the batch size, on the
other rows, or on dummy rows added by batch bucketing.

Stopping: a row stops at the first token in its stop set (EOS, end-of-turn, ...); the stop token
is part of the action and counted in its length. Positions after a row's end hold ``pad_id``
and log-prob 0. ``finished`` is True for rows ended by a stop token, False for rows truncated
by the budget.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from marft_jax.models import decoder
from marft_jax.models import lora as lora_lib
from marft_jax.models.config import ModelConfig
from marft_jax.sampling import buckets

Params = dict[str, Any]
_TOP_K_MIN_BUCKET = 64  # top-k values up to this share one compiled program


# --------------------------------------------------------------------------- token choice


@flax.struct.dataclass
class SamplingParams:
    """Traced sampling controls (changing them does not recompile).

    temperature: float32 scalar, 0 = greedy. top_k: int32 scalar, 0 = off (needs the static
    ``top_k_max >= top_k``). top_p: float32 scalar in (0, 1], 1 = off (needs static
    ``use_top_p``).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @classmethod
    def make(cls, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> "SamplingParams":
        if temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {temperature}")
        if top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {top_k}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {top_p}")
        return cls(temperature=jnp.float32(temperature), top_k=jnp.int32(top_k), top_p=jnp.float32(top_p))


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
        vals, _ = jax.lax.top_k(scaled, top_k_max)                        # [batch, top_k_max] sorted
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


# --------------------------------------------------------------------------- state


@flax.struct.dataclass
class SamplerState:
    """Everything the decode loop carries (donated between calls).

    cache: the KV cache (``prompt_bucket + max_new_tokens`` slots).
    tokens / logps: ``[batch, max_new]`` int32 / float32 output buffers.
    last: ``[batch]`` int32, the token to feed next; positions: ``[batch]`` int32, its RoPE
    position (``_advance`` moves both on together).
    done / finished: ``[batch]`` bool, ended for any reason / ended by a stop token.
    lengths: ``[batch]`` int32 generated tokens so far (stop token included).
    step: int32 scalar, generated positions so far; budget: int32 scalar, at most max_new.
    agent: int32 scalar or ``[batch]``; stop_ids: ``[batch, num_stop]`` int32 (-1 = unused slot).
    row_ids: ``[batch]`` int32 (per-row randomness); key: PRNG key; pad_id: int32 scalar.
    """

    cache: decoder.KVCache
    tokens: jax.Array
    logps: jax.Array
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
    logps: ``[batch, max_new]`` float32, ``log_softmax(z / T)[token]``, 0 after the end.
    finished: ``[batch]`` bool, True when the row ended with a stop token (False: truncated).
    steps: int32 scalar, generated positions the batch ran (loop iterations + 1 for prefill).
    """

    tokens: Any
    lengths: Any
    logps: Any
    finished: Any
    steps: Any


def _advance(s: SamplerState, cache: decoder.KVCache, tok: jax.Array, logp: jax.Array) -> SamplerState:
    """Write the tokens chosen at position ``s.step`` and update the stop bookkeeping."""
    live = ~s.done
    col = s.step
    tok_out = jnp.where(live, tok, s.pad_id)
    tokens = jax.lax.dynamic_update_slice_in_dim(s.tokens, tok_out[:, None], col, axis=1)
    logps = jax.lax.dynamic_update_slice_in_dim(s.logps, jnp.where(live, logp, 0.0)[:, None], col, axis=1)
    hit_stop = jnp.any(tok[:, None] == s.stop_ids, axis=-1) & live
    return s.replace(
        cache=cache, tokens=tokens, logps=logps, last=tok_out, positions=s.positions + 1,
        done=s.done | hit_stop, finished=s.finished | hit_stop,
        lengths=s.lengths + live.astype(jnp.int32), step=s.step + 1)


def _pick(s: SamplerState, logits: jax.Array, top_k_max: int, use_top_p: bool):
    u = row_uniforms(s.key, s.step, s.row_ids)
    return choose_tokens(logits, u, s.sampling, top_k_max=top_k_max, use_top_p=use_top_p)


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "top_k_max", "use_top_p"))
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
) -> SamplerState:
    """Run the prompts, fill a fresh KV cache and choose the first generated token.

    Args:
      params, lora: base weights and optional adapter stack (``agent`` selects the adapter).
      tokens, valid: ``[batch, prompt_bucket]`` int32 / bool, left-padded; every row has at
        least one valid token (its last position).
      active: ``[batch]`` bool, False for dummy rows (they start done and are never counted).
      agent: int32 scalar or ``[batch]``.
      stop_ids: ``[num_stop]`` or ``[batch, num_stop]`` int32 stop token ids (-1 = unused).
      key: PRNG key; sampling: traced temperature / top-k / top-p.
      budget: int32 scalar, tokens to generate at most (clipped to ``[1, max_new_tokens]``).
      pad_id: int32 scalar written after each row's end.
      max_new_tokens: static, the size of the output buffers and of the cache extension.
    Returns the :class:`SamplerState` after one generated position.
    """
    chex.assert_rank([tokens, valid, active], [2, 2, 1])
    b, length = tokens.shape
    stop_ids = jnp.asarray(stop_ids, jnp.int32)
    if stop_ids.ndim == 1:
        stop_ids = jnp.broadcast_to(stop_ids[None], (b, stop_ids.shape[0]))
    chex.assert_rank(stop_ids, 2)
    agent = jnp.asarray(agent, jnp.int32)
    cache = decoder.KVCache.init(cfg, b, length + max_new_tokens, dtype=params["embed"].dtype)
    hidden, cache = decoder.forward(params, tokens, valid, cfg=cfg, lora=lora,
                                    agent=agent if lora is not None else None, cache=cache)
    logits = decoder.logits_from_hidden(params, cfg, hidden[:, -1])
    state = SamplerState(
        cache=cache,
        tokens=jnp.full((b, max_new_tokens), pad_id, jnp.int32),
        logps=jnp.zeros((b, max_new_tokens), jnp.float32),
        last=jnp.zeros((b,), jnp.int32),
        positions=jnp.sum(valid, axis=-1, dtype=jnp.int32) - 1,   # of the last prompt token
        done=~active, finished=jnp.zeros((b,), bool), lengths=jnp.zeros((b,), jnp.int32),
        step=jnp.zeros((), jnp.int32),
        budget=jnp.clip(jnp.asarray(budget, jnp.int32), 1, max_new_tokens),
        agent=agent, stop_ids=stop_ids, row_ids=jnp.arange(b, dtype=jnp.int32), key=key,
        pad_id=jnp.asarray(pad_id, jnp.int32), sampling=sampling)
    tok, logp = _pick(state, logits, top_k_max, use_top_p)
    return _advance(state, cache, tok, logp)


@functools.partial(jax.jit, static_argnames=("cfg", "top_k_max", "use_top_p"), donate_argnums=(2,))
def decode(params: Params, lora: lora_lib.LoraStack | None, state: SamplerState, *,
           cfg: ModelConfig, top_k_max: int = 0, use_top_p: bool = False) -> SamplerState:
    """Decode until every row is done or ``state.budget`` positions are generated.

    ``state`` is donated: its cache and buffers are reused in place; never read it afterwards.
    """
    ones = jnp.ones((state.last.shape[0], 1), bool)
    use_lora = lora is not None

    def keep_going(s: SamplerState) -> jax.Array:
        return (s.step < s.budget) & ~jnp.all(s.done)

    def step(s: SamplerState) -> SamplerState:
        hidden, cache = decoder.forward(params, s.last[:, None], ones, cfg=cfg,
                                        positions=s.positions[:, None], lora=lora,
                                        agent=s.agent if use_lora else None, cache=s.cache)
        logits = decoder.logits_from_hidden(params, cfg, hidden[:, 0])
        tok, logp = _pick(s, logits, top_k_max, use_top_p)
        return _advance(s, cache, tok, logp)

    return jax.lax.while_loop(keep_going, step, state)


def result_of(state: SamplerState) -> SampleResult:
    """The :class:`SampleResult` view of a final state (device arrays)."""
    return SampleResult(tokens=state.tokens, lengths=state.lengths, logps=state.logps,
                        finished=state.finished, steps=state.step)


# --------------------------------------------------------------------------- host API


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """User-facing sampling settings (MARFT reference §3: training T=1, eval T=0.6)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        SamplingParams.make(self.temperature, self.top_k, self.top_p)  # validates


def stop_id_array(ids: Sequence[int], minimum: int = 8) -> np.ndarray:
    """Stop ids padded with -1 to a power-of-two size (>= ``minimum``): ``[num_stop]`` int32."""
    size = buckets.length_bucket(len(ids), minimum=minimum)
    out = np.full((size,), -1, np.int32)
    out[:len(ids)] = np.asarray(ids, np.int32)
    return out


class Sampler:
    """Host-side entry point: token-id lists in, NumPy results out (trimmed to the real rows).

    Prompts are bucketed (power-of-two length >= ``min_prompt_bucket`` and batch >=
    ``min_batch``) so a run compiles a handful of programs.

    Example::

        sampler = Sampler(cfg, pad_id=tok.pad_token_id, stop_ids=[eos, end_of_turn])
        out = sampler(params, prompts, key=jax.random.key(0),
                      config=SamplingConfig(max_new_tokens=128, temperature=1.0),
                      lora=stack, agent=1)
        out.tokens[i, :out.lengths[i]]    # row i's action, stop token included
    """

    def __init__(self, cfg: ModelConfig, *, pad_id: int = 0, stop_ids: Sequence[int] = (),
                 min_prompt_bucket: int = 16, max_prompt_len: int | None = None,
                 min_batch: int = 1, max_batch: int | None = None):
        self.cfg = cfg
        self.pad_id = int(pad_id)
        self.stop_ids = tuple(int(i) for i in stop_ids)
        self.min_prompt_bucket = min_prompt_bucket
        self.max_prompt_len = max_prompt_len
        self.min_batch = min_batch
        self.max_batch = max_batch

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
    ) -> SampleResult:
        """Sample one response per prompt.

        Args:
          params: base weights; prompts: token-id lists (non-empty).
          key: PRNG key; identical key and inputs give identical samples.
          config: max_new_tokens (static: buffer size), temperature / top-k / top-p (traced).
          lora, agent: adapter stack and agent index (one int, or one per prompt).
          stop_ids: overrides the sampler's stop set for this call.
          budget: generate at most this many tokens (<= max_new_tokens; traced, no recompile).
        Returns a :class:`SampleResult` of NumPy arrays with ``len(prompts)`` rows.
        """
        batch = buckets.pad_prompts(prompts, pad_id=self.pad_id, min_length=self.min_prompt_bucket,
                                    max_length=self.max_prompt_len, min_batch=self.min_batch,
                                    max_batch=self.max_batch)
        n, b = batch.num_real, batch.tokens.shape[0]
        if np.ndim(agent) == 0:
            agent_arr = jnp.int32(agent)
        else:
            if len(agent) != n:
                raise ValueError(f"agent has {len(agent)} entries for {n} prompts")
            agent_arr = jnp.asarray(np.pad(np.asarray(agent, np.int32), (0, b - n)))
        if lora is None:
            agent_arr = jnp.int32(0)
        ids = self.stop_ids if stop_ids is None else tuple(int(i) for i in stop_ids)
        stop = jnp.asarray(stop_id_array(ids))
        sampling = SamplingParams.make(config.temperature, config.top_k, config.top_p)
        top_k_max = top_k_bucket(config.top_k, self.cfg.vocab_size)
        use_top_p = config.top_p < 1.0
        state = prefill(params, lora, jnp.asarray(batch.tokens), jnp.asarray(batch.valid),
                        jnp.asarray(batch.active), agent_arr, stop, key, sampling,
                        jnp.int32(config.max_new_tokens if budget is None else budget),
                        jnp.int32(self.pad_id), cfg=self.cfg, max_new_tokens=config.max_new_tokens,
                        top_k_max=top_k_max, use_top_p=use_top_p)
        state = decode(params, lora, state, cfg=self.cfg, top_k_max=top_k_max, use_top_p=use_top_p)
        res = jax.device_get(result_of(state))
        return SampleResult(tokens=res.tokens[:n], lengths=res.lengths[:n], logps=res.logps[:n],
                            finished=res.finished[:n], steps=int(res.steps))
