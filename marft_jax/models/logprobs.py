"""Training-side forward: per-token log-probs and entropies of given actions, no ``[B, T, V]``.

The sequence of one (step, row, agent) is ``x = [ctx (L, left-padded) ‖ act (K, right-padded)]``;
logits at position ``p`` predict token ``p + 1``, so action token ``k`` is predicted at position
``L - 1 + k`` (docs/algorithm.md#notation-and-layout). Log-probs are taken under the sampling
temperature ``T``: ``log_softmax(z / T)[a]``; entropies ``H = logsumexp(z/T) - Σ softmax(z/T)·z/T``.

Logits are formed chunk by chunk over time inside a ``lax.scan`` whose body is wrapped in
``jax.checkpoint``: peak memory is O(batch·chunk·vocab) in the forward *and* the backward pass.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp

from marft_jax.models import decoder, sharding
from marft_jax.models.config import ModelConfig
from marft_jax.models.lora import LoraStack


def logprob_and_entropy(z: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``log_softmax(z)[target]`` and the full-vocabulary entropy of ``softmax(z)``.

    z: ``[..., vocab]`` float32 (temperature-scaled logits); targets: ``[...]`` int32.
    Returns ``(logp, entropy)``, both ``[...]`` float32. The one formula the training forward
    and the sampler's policy log-probs share (so PPO can use the sampler's as old log-probs).
    """
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    return picked - lse, lse - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)


LOGITS_CHUNK_BYTES = 64 << 20                 # CPU: a chunk's logits stay near the caches
ACCELERATOR_LOGITS_CHUNK_BYTES = 1 << 30     # GPU / TPU: >= 1765 positions of a 152k vocabulary
ACCELERATOR_CHUNK_MEMORY_FRACTION = 32       # ... and at most 1/32 of the device's memory


def logits_chunk_bytes(backend: str | None = None, device_memory_bytes: int | None = None) -> int:
    """Float32 logit bytes one chunk of :func:`chunked_logprobs` may hold on ``backend``
    (default: JAX's default backend).

    The CPU keeps :data:`LOGITS_CHUNK_BYTES` (64 MiB: fastest there, and the CPU results are
    pinned). An accelerator re-reads the whole ``[H, vocab]`` head once per chunk, so 64 MiB
    (~13 positions of 8 rows at a 152k vocabulary, ~40 reads per forward) would make the head
    memory-bound: it gets :data:`ACCELERATOR_LOGITS_CHUNK_BYTES`, bounded by
    ``device_memory_bytes / ACCELERATOR_CHUNK_MEMORY_FRACTION`` (the log-softmax and its
    gradient keep a few buffers of the chunk's size), where the device reports its memory.
    """
    b = backend or jax.default_backend()
    if b == "cpu":
        return LOGITS_CHUNK_BYTES
    if device_memory_bytes is None:
        device_memory_bytes = _device_memory_bytes()
    cap = ACCELERATOR_LOGITS_CHUNK_BYTES
    if device_memory_bytes:
        cap = min(cap, device_memory_bytes // ACCELERATOR_CHUNK_MEMORY_FRACTION)
    return max(LOGITS_CHUNK_BYTES, cap)


def _device_memory_bytes() -> int | None:
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:   # backends without memory stats
        return None
    return stats.get("bytes_limit")


def chunked_logprobs(
    hidden: jax.Array,
    head: jax.Array | decoder.Head,
    targets: jax.Array,
    temperature: float | jax.Array = 1.0,
    chunk: int = 128,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of ``targets`` and full-vocabulary entropy, chunked over time.

    Args:
      hidden: ``[batch, time, H]`` last-layer hidden states at the predicting positions.
      head: ``[H, vocab]`` LM-head matrix, or a :class:`~marft_jax.models.decoder.Head` in its
        stored layout (what the update passes: no transposed copy of a tied embedding).
      targets: ``[batch, time]`` int32 token predicted at each position.
      temperature: sampling temperature T (> 0).
      chunk: at most this many positions per chunk (fewer when ``batch x chunk x vocab`` float32
        logits would pass :func:`logits_chunk_bytes`); the time axis is padded to a multiple.
    Returns:
      ``(logp, entropy)``, both ``[batch, time]`` float32.
    """
    chex.assert_rank(hidden, 3)
    chex.assert_rank(targets, 2)
    head = head if isinstance(head, decoder.Head) else decoder.Head(head, vocab_major=False)
    vocab = head.weight.shape[0 if head.vocab_major else 1]
    b, t, h = hidden.shape
    # At most ~logits_chunk_bytes() of float32 logits per chunk: [b, chunk, vocab] and the few
    # buffers of its size the log-softmax and its gradient keep (the update's largest temporaries
    # on the reference workload were these: 12 x 128 x 49,152 x 4 B = 302 MB each).
    chunk = max(1, min(chunk, t, logits_chunk_bytes() // max(1, b * vocab * 4)))
    n = -(-t // chunk)
    pad = n * chunk - t
    hid = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, h).swapaxes(0, 1)
    tgt = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)
    inv_t = 1.0 / jnp.asarray(temperature, jnp.float32)

    @jax.checkpoint
    def one(hc, tc):
        z = head.logits(hc) * inv_t
        return logprob_and_entropy(z, tc)

    def body(_, xs):
        return None, one(*xs)

    _, (logp, ent) = jax.lax.scan(body, None, (hid, tgt))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
    return unchunk(logp), unchunk(ent)


def concat_context_action(ctx_tokens, ctx_valid, act_tokens, act_valid):
    """``[B, L] ‖ [B, K] -> [B, L + K]`` tokens and validity (left-padded ctx, right-padded act)."""
    return (jnp.concatenate([ctx_tokens, act_tokens], axis=1),
            jnp.concatenate([ctx_valid, act_valid], axis=1))


@functools.partial(jax.jit, static_argnames=("cfg", "chunk", "remat"))
def action_logprobs(
    params: decoder.Params,
    lora: LoraStack | None,
    agent: jax.Array,
    ctx_tokens: jax.Array,
    ctx_valid: jax.Array,
    act_tokens: jax.Array,
    act_valid: jax.Array,
    temperature: jax.Array | float,
    *,
    cfg: ModelConfig,
    chunk: int = 128,
    remat: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Per-token log-probs and entropies of the actions under base + the agent's LoRA.

    Args:
      ctx_tokens, ctx_valid: ``[batch, L]`` left-padded contexts.
      act_tokens, act_valid: ``[batch, K]`` right-padded actions (``valid`` from lengths).
      agent: int32 scalar or ``[batch]`` adapter index.
    Returns:
      ``(logp, entropy)`` ``[batch, K]`` float32, zero where ``act_valid`` is False.
    """
    return action_logprobs_fn(params, lora, agent, ctx_tokens, ctx_valid, act_tokens, act_valid,
                              temperature, cfg=cfg, chunk=chunk, remat=remat)


def action_logprobs_fn(params, lora, agent, ctx_tokens, ctx_valid, act_tokens, act_valid,
                       temperature, *, cfg: ModelConfig, chunk: int = 128, remat: bool = False):
    """Un-jitted body of :func:`action_logprobs` (for use inside larger jitted programs): the
    padded layout as packed rows of one sequence each (:func:`packed_action_logprobs_fn`)."""
    chex.assert_equal_shape([ctx_tokens, ctx_valid])
    chex.assert_equal_shape([act_tokens, act_valid])
    L, K = ctx_tokens.shape[1], act_tokens.shape[1]
    tokens, valid = concat_context_action(ctx_tokens, ctx_valid, act_tokens, act_valid)
    rows = tokens.shape[0]
    gather = (jnp.arange(rows, dtype=jnp.int32)[:, None] * (L + K) + (L - 1)
              + jnp.arange(K, dtype=jnp.int32)[None, :])                 # positions L-1 .. L+K-2
    return packed_action_logprobs_fn(params, lora, agent, decoder.padded_rows(tokens, valid), gather,
                                     act_tokens, act_valid, temperature, cfg=cfg, chunk=chunk, remat=remat)


def packed_action_logprobs_fn(params, lora, agent, rows, gather, act_tokens, act_valid, temperature, *,
                              cfg: ModelConfig, chunk: int = 128, remat: bool | None = False):
    """:func:`action_logprobs_fn` on packed rows (:mod:`marft_jax.rl.packing`).

    Args:
      rows: :class:`~marft_jax.models.decoder.PackedRows` ``[R, T]`` (or one per length class)
        holding the sequences ``ctx ‖ act`` (valid tokens only), block-diagonal causal attention
        per segment.
      gather: ``[n, K]`` int32 flat indices into the slots (classes end to end): the position
        predicting each action token of each of the ``n`` sequences.
      act_tokens, act_valid: ``[n, K]`` the actions (right-padded).
      remat: as :func:`~marft_jax.models.decoder.resolve_remat` (None: auto per class).
    Returns:
      ``(logp, entropy)`` ``[n, K]`` float32, zero where ``act_valid`` is False.
    """
    chex.assert_equal_shape([act_tokens, act_valid, gather])
    flat = decoder.forward_packed(params, rows, cfg=cfg, lora=lora, agent=agent, remat=remat)
    # Keep the gathered states split over the data shards: the vocabulary head then runs on
    # 1/D of the positions per device instead of all of them on every device.
    pred = sharding.constrain_rows(jnp.take(flat, gather, axis=0))      # [n, K, H]
    logp, ent = chunked_logprobs(pred, decoder.output_head(params, cfg), act_tokens, temperature, chunk)
    return jnp.where(act_valid, logp, 0.0), jnp.where(act_valid, ent, 0.0)
