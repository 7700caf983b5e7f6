"""The pure-functional decoder: embed -> scanned blocks -> final norm -> hidden / logits.

Parameters are a nested dict pytree; every per-layer array is stacked on a leading
``[layer]`` axis and the blocks run under one ``lax.scan`` (compile time does not grow with
depth). The frozen base is stored once; agents differ only by the LoRA stack selected inside
jit (``marft_jax.models.lora``).

Parameter layout (``Q = heads·head_dim``, ``KV = kv_heads·head_dim``, kernels are ``x @ W``)::

    embed:        [vocab, H]
    layers/input_norm, layers/post_norm:               [layer, H]
    layers/{q,k,v}_proj/kernel: [layer, H, Q|KV]       (+ bias [layer, Q|KV] when qkv_bias)
    layers/o_proj/kernel:       [layer, Q, H]          (+ bias when o_bias)
    layers/{gate,up}_proj/kernel: [layer, H, F];  layers/down_proj/kernel: [layer, F, H]
    final_norm:   [H]
    lm_head:      [H, vocab]   (absent when tie_word_embeddings)

Numerics: matmuls in the parameter dtype (bf16 on GPU/TPU, float32 on CPU); RMSNorm, RoPE,
softmax and LoRA in float32.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from marft_jax.models import lora as lora_lib
from marft_jax.models.config import ModelConfig

Params = dict[str, Any]
_NEG = -1e30  # finite "minus infinity": fully masked (pad) query rows stay NaN-free


@flax.struct.dataclass
class KVCache:
    """Preallocated key/value cache with a shared write cursor.

    k, v: ``[layer, batch, kv_heads, slots, head_dim]`` (head-major: attention reads a layer's
    slice without a transpose); valid: ``[batch, slots]`` bool, True where a real (non-pad)
    token was written; index: int32 scalar, the next slot to write. All rows share the cursor
    because prompts are left-padded to a common length. ``forward`` writes new keys/values into
    the layer stack in place (the stack rides in the layer scan's carry), so with a donated
    cache a decode step moves only the new entries, not the whole cache.
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    index: jax.Array

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, slots: int, dtype=jnp.float32) -> "KVCache":
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, slots, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   valid=jnp.zeros((batch, slots), bool), index=jnp.zeros((), jnp.int32))


def init_params(key: jax.Array, cfg: ModelConfig, dtype=jnp.float32, std: float = 0.02) -> Params:
    """Random parameters (tests, benchmarks). Norm weights start at 1, biases small random."""
    n, h, f = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    ks = iter(jax.random.split(key, 16))
    rnd = lambda shape: (std * jax.random.normal(next(ks), shape, jnp.float32)).astype(dtype)
    layers: dict[str, Any] = {
        "input_norm": jnp.ones((n, h), dtype), "post_norm": jnp.ones((n, h), dtype),
        "q_proj": {"kernel": rnd((n, h, cfg.q_size))}, "k_proj": {"kernel": rnd((n, h, cfg.kv_size))},
        "v_proj": {"kernel": rnd((n, h, cfg.kv_size))}, "o_proj": {"kernel": rnd((n, cfg.q_size, h))},
        "gate_proj": {"kernel": rnd((n, h, f))}, "up_proj": {"kernel": rnd((n, h, f))},
        "down_proj": {"kernel": rnd((n, f, h))},
    }
    if cfg.qkv_bias:
        layers["q_proj"]["bias"] = rnd((n, cfg.q_size))
        layers["k_proj"]["bias"] = rnd((n, cfg.kv_size))
        layers["v_proj"]["bias"] = rnd((n, cfg.kv_size))
    if cfg.o_bias:
        layers["o_proj"]["bias"] = rnd((n, h))
    params = {"embed": rnd((cfg.vocab_size, h)), "layers": layers, "final_norm": jnp.ones((h,), dtype)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = rnd((h, cfg.vocab_size))
    return params


def cast_params(params: Params, dtype) -> Params:
    """Cast every floating base parameter to ``dtype`` (bf16 on accelerators)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def position_ids(valid: jax.Array) -> jax.Array:
    """RoPE positions that skip left padding: ``cumsum(valid) - 1`` clipped at 0. [B, T] int32."""
    return jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, result in ``x.dtype`` (HF: normalise in fp32, then scale)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * xf).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, HF ``rotate_half`` convention. x: [B, T, heads, D]; positions: [B, T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(jnp.concatenate([ang, ang], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([ang, ang], -1))[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention with a boolean mask, softmax in float32.

    q: [B, T, heads, D]; k, v: [B, kv_heads, S, D] (head-major); mask: [B, T, S] (True = may
    attend). Returns [B, T, heads, D].
    """
    b, t, nh, d = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    # Batch-major [B, kv_heads, group*T, D] queries: both einsums are plain batched matmuls
    # (no transposed operands or outputs), ~3x faster for decode on XLA:CPU.
    qg = q.reshape(b, t, nkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, nkv, g * t, d)
    scores = jnp.einsum("bkqd,bksd->bkqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / np.sqrt(d))
    mask = jnp.broadcast_to(mask[:, None, None], (b, 1, g, t, mask.shape[-1])).reshape(b, 1, g * t, -1)
    scores = jnp.where(mask, scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, v).reshape(b, nkv, g, t, d)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, nh, d)


def _proj(x, p, name, lora_a, lora_b, scale, per_row):
    y = x @ p[name]["kernel"]
    if "bias" in p[name]:
        y = y + p[name]["bias"]
    if lora_a is not None and name in lora_a:
        y = y + lora_lib.lora_delta(x, lora_a[name], lora_b[name], scale, per_row)
    return y


def _block(cfg: ModelConfig, x, p, la, lb, scale, per_row, positions, kv_in, mask_fn):
    """One decoder block. Returns ``(x_out, kv_out)``.

    Without a cache (``kv_in is None``) attention is over this call's keys and ``kv_out`` is
    None. With one, ``kv_in = (k_stack, v_stack, layer, index)`` holds every layer's cache
    ``[layer, B, kv_heads, slots, D]``; the new keys/values are written at ``(layer, index)``
    in place and ``kv_out`` is the updated stacks.
    """
    b, t, _ = x.shape
    h = rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
    q = _proj(h, p, "q_proj", la, lb, scale, per_row).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = _proj(h, p, "k_proj", la, lb, scale, per_row).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = _proj(h, p, "v_proj", la, lb, scale, per_row).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    q = rope(q, positions, cfg.rope_theta)
    k = rope(k, positions, cfg.rope_theta)
    k = jnp.swapaxes(k, 1, 2)                                   # [B, kv_heads, T, D]
    v = jnp.swapaxes(v, 1, 2)
    kv_out = None
    if kv_in is not None:
        ks, vs, layer, index = kv_in
        zero = jnp.zeros((), jnp.int32)
        at = (layer, zero, zero, index, zero)
        ks = jax.lax.dynamic_update_slice(ks, k.astype(ks.dtype)[None], at)
        vs = jax.lax.dynamic_update_slice(vs, v.astype(vs.dtype)[None], at)
        k = jax.lax.dynamic_index_in_dim(ks, layer, 0, keepdims=False)
        v = jax.lax.dynamic_index_in_dim(vs, layer, 0, keepdims=False)
        kv_out = (ks, vs)
    o = attention(q, k.astype(q.dtype), v.astype(q.dtype), mask_fn).reshape(b, t, cfg.q_size)
    x = x + _proj(o, p, "o_proj", la, lb, scale, per_row)
    h = rms_norm(x, p["post_norm"], cfg.rms_norm_eps)
    gate = _proj(h, p, "gate_proj", la, lb, scale, per_row)
    up = _proj(h, p, "up_proj", la, lb, scale, per_row)
    x = x + _proj(jax.nn.silu(gate) * up, p, "down_proj", la, lb, scale, per_row)
    return x, kv_out


def forward(
    params: Params,
    tokens: jax.Array,
    valid: jax.Array,
    *,
    cfg: ModelConfig,
    positions: jax.Array | None = None,
    lora: lora_lib.LoraStack | None = None,
    agent: jax.Array | int | None = None,
    cache: KVCache | None = None,
    remat: bool = False,
) -> tuple[jax.Array, KVCache | None]:
    """Run the decoder and return the last-layer hidden states (after the final norm).

    Args:
      params: base parameters (see module docstring); never closed over, always an argument.
      tokens: ``[batch, time]`` int32, left-padded prompts or new decode tokens.
      valid: ``[batch, time]`` bool, True for real tokens (masks come from lengths, never
        from comparing ids with the pad id).
      cfg: static model config.
      positions: ``[batch, time]`` RoPE positions; default ``position_ids(valid)`` (only
        right for a whole sequence; decode steps must pass them).
      lora: optional per-agent adapter stack; ``agent`` (int32 scalar or ``[batch]``) selects it.
      cache: optional KV cache; the new keys/values are written at ``cache.index`` and the
        queries attend to every valid earlier slot. Without a cache attention is causal over
        ``tokens`` only.
      remat: recompute each block in the backward pass (activation memory O(1) in depth).
    Returns:
      ``(hidden [batch, time, H] in the parameter dtype, updated cache or None)``.
    """
    chex.assert_rank(tokens, 2)
    chex.assert_equal_shape([tokens, valid])
    b, t = tokens.shape
    if positions is None:
        positions = position_ids(valid)
    x = jnp.take(params["embed"], tokens, axis=0)

    if lora is not None:
        if agent is None:
            raise ValueError("forward: `agent` is required when `lora` is given")
        la, lb, per_row = lora_lib.select_agent_adapter(lora, agent)
        scale = lora.scale
    else:
        la = lb = None
        per_row, scale = False, 0.0

    if cache is None:
        slot_q = jnp.arange(t)
        key_valid = valid
        slot_k = jnp.arange(t)
        new_valid = None
    else:
        slot_q = cache.index + jnp.arange(t)
        new_valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, valid, cache.index, axis=1)
        key_valid = new_valid
        slot_k = jnp.arange(cache.valid.shape[1])
    mask = key_valid[:, None, :] & (slot_k[None, None, :] <= slot_q[None, :, None])

    # The cache stacks ride in the carry (updated in place), not in xs/ys: scanning them as
    # xs -> ys would copy every layer's whole cache on every decode step.
    def body(carry, xs):
        x, kv = carry
        p, la_l, lb_l, layer = xs
        kv_in = None if kv is None else (kv[0], kv[1], layer, cache.index)
        x, kv_out = _block(cfg, x, p, la_l, lb_l, scale, per_row, positions, kv_in, mask)
        return (x, kv_out), None

    if remat:
        body = jax.checkpoint(body, prevent_cse=False)
    kv0 = None if cache is None else (cache.k, cache.v)
    layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, kv_out), _ = jax.lax.scan(body, (x, kv0), (params["layers"], la, lb, layers))
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    if cache is None:
        return hidden, None
    new_cache = KVCache(k=kv_out[0], v=kv_out[1], valid=new_valid, index=cache.index + t)
    return hidden, new_cache


def lm_head(params: Params, cfg: ModelConfig) -> jax.Array:
    """The output projection ``[H, vocab]`` (the transposed embedding when tied)."""
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def logits_from_hidden(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """``[..., H] -> [..., vocab]`` float32 logits (accumulated in float32)."""
    w = lm_head(params, cfg)
    return jnp.einsum("...h,hv->...v", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg", "remat"))
def logits_fn(params: Params, tokens: jax.Array, valid: jax.Array, cfg: ModelConfig,
              lora: lora_lib.LoraStack | None = None, agent: jax.Array | None = None,
              remat: bool = False) -> jax.Array:
    """Full ``[batch, time, vocab]`` float32 logits (tests and small evaluations only)."""
    hidden, _ = forward(params, tokens, valid, cfg=cfg, lora=lora, agent=agent, remat=remat)
    return logits_from_hidden(params, cfg, hidden)
