"""The pure-functional decoder: embed -> scanned blocks -> final norm -> hidden / logits.

Parameters are a nested dict pytree; every per-layer array is stacked on a leading
``[layer]`` axis and the blocks run under one ``lax.scan`` (compile time does not grow with
depth). The frozen base is stored once; agents differ only by the LoRA stack selected inside
jit (``marft_jax.models.lora``).

Parameter layout (``Q = heads·head_dim``, ``KV = kv_heads·head_dim``, kernels are ``x @ W``)::

    embed:        [vocab, H]
    layers/input_norm, layers/post_norm:               [layer, H]
    layers/{q,k,v}_proj/kernel: [layer, H, Q|KV]       (+ bias [layer, Q|KV] when qkv_bias)
    layers/{q,k}_norm:          [layer, head_dim]      (when qk_norm: per-head RMSNorm, Qwen3)
    layers/o_proj/kernel:       [layer, Q, H]          (+ bias when o_bias)
    layers/{gate,up}_proj/kernel: [layer, H, F];  layers/down_proj/kernel: [layer, F, H]
    final_norm:   [H]
    lm_head:      [H, vocab]   (absent when tie_word_embeddings)
    quantized:    optional, only in the sampler's decode calls (``model.decode_weights=native``):
                  a GGUF file's blocks, ``{"layers": {proj: [layer, N, K/32 * block bytes]},
                  "lm_head": [vocab, H/32 * block bytes]}`` uint8 (:mod:`marft_jax.models.quant_matmul`)

Numerics: matmuls in the parameter dtype (bf16 on GPU/TPU, float32 on CPU); RMSNorm, RoPE,
softmax and LoRA in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, NamedTuple

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from marft_jax.models import attention as attention_lib
from marft_jax.models import cache_attention, causal_attention, layer_matmul, quant_matmul
from marft_jax.models import lora as lora_lib
from marft_jax.models import sharding
from marft_jax.models.config import ModelConfig

Params = dict[str, Any]


@flax.struct.dataclass
class KVCache:
    """Preallocated key/value cache with a shared write cursor.

    k, v: ``[layer, batch, kv_heads, slots, head_dim]`` (head-major: attention reads a layer's
    slice without a transpose); valid: ``[batch, slots]`` bool, True where a real (non-pad)
    token was written; index: int32 scalar, the next slot to write. All rows share the cursor
    because prompts are left-padded to a common length.

    ``forward`` keeps the cache read-only inside the layer scan (each layer reads its own slice
    of the filled slots), attends over those slots plus the new tokens' own keys/values, emits
    only the new ``[layer, batch, kv_heads, time, head_dim]`` entries and writes them with one
    ``dynamic_update_slice`` after the scan: with a donated cache a decode step moves only the
    new entries, never a whole layer or the whole stack. The sampler sizes the cache to the
    bound of each decode phase (:mod:`marft_jax.sampling.sampler`), so attention reads only
    ``slots`` keys, not the final length.
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


class CacheRead(NamedTuple):
    """What a block reads of the KV cache: the whole stacks ``k``/``v``
    ``[layer, B, kv_heads, slots, D]``, this block's ``layer`` index and ``ok`` ``[B, P]``, the
    readable slots among the first ``P`` (``None``: nothing is read, a prefill into an empty
    cache). :func:`_attend_cache` reads them per ``cfg.decode_attention``."""

    k: jax.Array
    v: jax.Array
    layer: jax.Array
    ok: jax.Array | None


# The native cache-attention kernel walks each (row, kv head)'s query rows one by one: right for
# decode steps; a prefill of 256 new tokens over 640 reused slots ran 27 ms a layer in it
# against a few ms as XLA's batched matmuls (SmolLM2-135M, 4 rows).
NATIVE_ATTENTION_MAX_NEW = 8


def _attend_cache(cfg: ModelConfig, q, k, v, mask_fn, read: CacheRead):
    """Attention of the new tokens (``q`` ``[B, T, heads, D]``, ``k``/``v``
    ``[B, kv_heads, T, D]``, ``mask_fn`` ``[B, T, T]``) over the cached slots ``read.ok`` and
    their own keys. ``native``: the kernel reads the layer's slots in place (calls of at most
    :data:`NATIVE_ATTENTION_MAX_NEW` new tokens a row: decode steps); ``xla``, and longer calls (a
    prefill after a reused prefix): the layer's first ``P`` slots are sliced out of the stacks
    (XLA:CPU copies them) and attention runs as batched matmuls."""
    if cfg.decode_attention == "native" and q.shape[1] <= NATIVE_ATTENTION_MAX_NEW:
        return cache_attention.attend(q, k, v, mask_fn, read.k, read.v, read.layer, read.ok)
    b, t = q.shape[:2]
    p = read.ok.shape[1]
    zero = jnp.zeros((), jnp.int32)
    at = (read.layer, zero, zero, zero, zero)
    size = (1,) + read.k.shape[1:3] + (p, read.k.shape[4])
    k_pre = jax.lax.dynamic_slice(read.k, at, size)[0].astype(q.dtype)
    v_pre = jax.lax.dynamic_slice(read.v, at, size)[0].astype(q.dtype)
    prefix = (k_pre, v_pre, jnp.broadcast_to(read.ok[:, None, :], (b, t, p)))
    return attention_lib.xla_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask_fn, prefix, causal=True)


@flax.struct.dataclass
class PackedRows:
    """Sequences packed into rows (any leading axes ``[..., R, T]``), int32 each: ``tokens``,
    ``segment_ids`` (0 = padding; a token attends only to earlier tokens of its own segment),
    per-segment RoPE ``positions`` and optional ``branch_ids`` (shared prefixes: 0 = a
    segment's trunk, visible to all its tokens; ``k > 0`` = a branch, visible to itself only).
    Built by :mod:`marft_jax.rl.packing`; the padded layout is the special case of one
    sequence per row (:func:`padded_rows`)."""

    tokens: jax.Array
    segment_ids: jax.Array
    positions: jax.Array
    branch_ids: jax.Array | None = None


def padded_rows(tokens: jax.Array, valid: jax.Array) -> PackedRows:
    """``[B, T]`` padded sequences (one per row) as :class:`PackedRows`."""
    return PackedRows(tokens=tokens, segment_ids=valid.astype(jnp.int32), positions=position_ids(valid))


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
    if cfg.qk_norm:
        layers["q_norm"] = jnp.ones((n, cfg.head_dim), dtype)
        layers["k_norm"] = jnp.ones((n, cfg.head_dim), dtype)
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


def rope(x: jax.Array, positions: jax.Array, theta: float, inv_freq: np.ndarray | None = None) -> jax.Array:
    """Rotary embedding, HF ``rotate_half`` convention. x: [B, T, heads, D]; positions: [B, T].

    ``inv_freq``: float32 ``[D/2]`` radians per position (:meth:`ModelConfig.rope_inv_freq`,
    scaled RoPE); default ``theta ** (-2i / D)``."""
    d = x.shape[-1]
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(jnp.concatenate([ang, ang], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([ang, ang], -1))[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


attention = attention_lib.xla_attention  # the XLA implementation (kept under its old name)


class StackedKernel(NamedTuple):
    """A projection's weights as the whole ``[layer, K, N]`` stack and the layer to read
    (``model.decode_matmul=native``: :func:`marft_jax.models.layer_matmul.matmul` reads the
    block in place instead of the scan slicing, and XLA:CPU copying, it)."""

    stack: jax.Array
    layer: jax.Array


class QuantKernel(NamedTuple):
    """A projection's weights as a GGUF checkpoint's blocks, ``[layer, N, K/32 * block bytes]``
    uint8, and the layer to read (``model.decode_weights=native``:
    :func:`marft_jax.models.quant_matmul.matmul` dequantizes them in registers)."""

    blocks: jax.Array
    layer: jax.Array


QUANTIZED = "quantized"   # params key of the blocks (gguf_loader.quantized_blocks), set by the sampler


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _proj(x, p, name, lora_a, lora_b, scale, per_row):
    w = p[name]["kernel"]
    if isinstance(w, QuantKernel):
        y = quant_matmul.matmul(x, w.blocks, w.layer)
    elif isinstance(w, StackedKernel):
        y = layer_matmul.matmul(x, w.stack, w.layer)
    else:
        y = x @ w
    if "bias" in p[name]:
        y = y + p[name]["bias"]
    if lora_a is not None and name in lora_a:
        y = y + lora_lib.lora_delta(x, lora_a[name], lora_b[name], scale, per_row)
    return y


def _block(cfg: ModelConfig, x, p, la, lb, scale, per_row, positions, cache_in, mask_fn, segment_ids=None,
           branched: bool = False):
    """One decoder block. Returns ``(x_out, kv_new)``.

    Without a cache (``cache_in is None``) attention is over this call's keys and ``kv_new`` is
    None. With one, ``cache_in`` is a :class:`CacheRead` of the read-only cache; attention runs
    over its readable slots (none for a prefill into an empty cache) and the new keys, and
    ``kv_new = (k, v)`` ``[B, kv_heads, T, D]`` are the entries to write. Attention
    without cached keys runs ``cfg.attention`` (:mod:`marft_jax.models.attention`) on
    ``segment_ids`` when it is not ``xla``; otherwise the boolean ``mask_fn`` ``[B, T, T]``.
    ``branched``: the mask also holds shared-prefix branches (kernels then need ``mask_fn``).
    """
    b, t, _ = x.shape
    h = rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
    q = _proj(h, p, "q_proj", la, lb, scale, per_row).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = _proj(h, p, "k_proj", la, lb, scale, per_row).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = _proj(h, p, "v_proj", la, lb, scale, per_row).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    inv_freq = cfg.rope_inv_freq()
    q = rope(q, positions, cfg.rope_theta, inv_freq)
    k = rope(k, positions, cfg.rope_theta, inv_freq)
    k = jnp.swapaxes(k, 1, 2)                                   # [B, kv_heads, T, D]
    v = jnp.swapaxes(v, 1, 2)
    kv_new = None if cache_in is None else (k, v)
    if cache_in is not None and cache_in.ok is not None:
        o = _attend_cache(cfg, q, k, v, mask_fn, cache_in)
    elif cfg.attention != "xla" and segment_ids is not None:
        o = attention_lib.segment_attention(q, k.astype(q.dtype), v.astype(q.dtype), segment_ids, impl=cfg.attention,
                                            mask=mask_fn if branched else None)
    elif cfg.causal_attention == "native" and causal_attention.supports(cfg.head_dim):
        o = causal_attention.attend(q, k, v, mask_fn)                # mask_fn is causal
    else:
        o = attention_lib.xla_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask_fn, causal=True)  # mask_fn is causal
    o = o.reshape(b, t, cfg.q_size)
    x = x + _proj(o, p, "o_proj", la, lb, scale, per_row)
    h = rms_norm(x, p["post_norm"], cfg.rms_norm_eps)
    gate = _proj(h, p, "gate_proj", la, lb, scale, per_row)
    up = _proj(h, p, "up_proj", la, lb, scale, per_row)
    x = x + _proj(jax.nn.silu(gate) * up, p, "down_proj", la, lb, scale, per_row)
    return x, kv_new


def _fsdp_gathered(layer: Params) -> Params:
    """One layer's weights (the scan's slice, no layer axis) whole over ``fsdp`` (still split over
    ``tensor``): each device all-gathers the layer it is about to run, as FSDP / ZeRO-3 does,
    instead of leaving XLA free to move the row-split activations to the split weights. A no-op
    without a context mesh or with ``fsdp`` = 1."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "fsdp" not in mesh.axis_names or mesh.shape["fsdp"] == 1:
        return layer
    rules = dataclasses.replace(sharding.AxisRules(), embed=None)

    def one(path, w):
        keys = ("layers",) + sharding.path_keys(path)
        logical = sharding.logical_axes(keys, w.ndim + 1)[1:]
        with warnings.catch_warnings():          # the placement already warned about rules that cannot apply
            warnings.simplefilter("ignore")
            spec = sharding.to_pspec(logical, w.shape, mesh, rules)
        return jax.lax.with_sharding_constraint(w, spec)
    return jax.tree_util.tree_map_with_path(one, layer)


def _rows_split(x: jax.Array) -> jax.Array:
    """The hidden states ``[B, T, H]`` split on rows over the mesh's batch axes (``data`` x
    ``fsdp``), ``H`` whole. Under ``fsdp`` the weights are split on ``H``: without this XLA keeps
    them in place and has every device compute partial sums of *all* rows (activations as large
    as on one device, an all-reduce per matmul); with it each device keeps its rows and the layer's
    weights are all-gathered (ZeRO-3 / FSDP). A no-op without a context mesh."""
    return sharding.constrain_rows(x)


def _decode_kernels(params: Params, cfg: ModelConfig, rows: int) -> dict[str, tuple[type, jax.Array]]:
    """Projection -> (:class:`QuantKernel` or :class:`StackedKernel`, its whole stack) for a cached
    forward of ``rows`` rows (batch x new tokens); empty when neither native kernel applies."""
    out: dict[str, tuple[type, jax.Array]] = {}
    quantized = params.get(QUANTIZED, {}).get("layers", {})
    if cfg.decode_weights == "native" and rows <= quant_matmul.MAX_ROWS:
        out.update({n: (QuantKernel, quantized[n]) for n in PROJECTIONS if n in quantized})
    if cfg.decode_matmul == "native" and rows <= layer_matmul.MAX_ROWS:
        out.update({n: (StackedKernel, params["layers"][n]["kernel"]) for n in PROJECTIONS if n not in out})
    return out


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
    remat: bool | str = False,
    segment_ids: jax.Array | None = None,
    read_slots: int | None = None,
    branch_ids: jax.Array | None = None,
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
      cache: optional KV cache; the queries attend to every valid slot before ``cache.index``
        (among the first ``read_slots``) and causally to the new tokens, whose keys/values are
        then written at ``cache.index`` (``index + time <= slots`` is the caller's duty). Without
        a cache attention is causal over ``tokens`` only.
      remat: what each block keeps for the backward pass: a :data:`REMAT_POLICIES` name, or
        True (``full``: recompute each block, activation memory O(1) in depth) / False.
      segment_ids: optional ``[batch, time]`` int32 for packed rows (no cache): several
        sequences share a row, ``0`` marks padding, and a token attends only to earlier tokens
        of its own segment (block-diagonal causal mask). Pass per-segment ``positions`` with it
        (see :mod:`marft_jax.rl.packing`); ``valid`` is then ``segment_ids > 0``.
      read_slots: static, with a cache: how many leading cache slots attention may read
        (default all; ``0`` for a prefill into an empty cache, which then attends over the
        prompt's own keys only).
      branch_ids: optional ``[batch, time]`` int32 with ``segment_ids``: shared prefixes
        (:func:`marft_jax.rl.packing.share_prefixes`); a token also needs the key's branch to be
        0 (the trunk) or its own. Needs ``model.attention`` xla or cudnn (a dense mask).
    Returns:
      ``(hidden [batch, time, H] in the parameter dtype, updated cache or None)``.
    """
    chex.assert_rank(tokens, 2)
    chex.assert_equal_shape([tokens, valid])
    b, t = tokens.shape
    if positions is None:
        positions = position_ids(valid)
    x = _rows_split(jnp.take(params["embed"], tokens, axis=0))

    if lora is not None:
        if agent is None:
            raise ValueError("forward: `agent` is required when `lora` is given")
        la, lb, per_row = lora_lib.select_agent_adapter(lora, agent)
        scale = lora.scale
    else:
        la = lb = None
        per_row, scale = False, 0.0

    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]             # [T(query), T(key)]
    mask = valid[:, None, :] & causal[None]
    if segment_ids is not None:
        if cache is not None:
            raise ValueError("forward: segment_ids (packed rows) cannot be used with a KV cache")
        chex.assert_equal_shape([tokens, segment_ids])
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    if branch_ids is not None:
        if segment_ids is None:
            raise ValueError("forward: branch_ids need segment_ids (packed rows)")
        chex.assert_equal_shape([tokens, branch_ids])
        mask = mask & ((branch_ids[:, None, :] == 0) | (branch_ids[:, :, None] == branch_ids[:, None, :]))
    seg = segment_ids if segment_ids is not None else valid.astype(jnp.int32)   # kernels' segment view

    if cache is None:
        def body(x, xs):
            p, la_l, lb_l = xs
            x, p = _rows_split(x), _fsdp_gathered(p)
            x, _ = _block(cfg, x, p, la_l, lb_l, scale, per_row, positions, None, mask, seg, branch_ids is not None)
            return x, None

        body = _remat(body, resolve_remat(remat, t))
        x, _ = jax.lax.scan(body, x, (params["layers"], la, lb))
        return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), None

    # Cache path: the cache is read-only inside the layer scan (each layer reads its own
    # filled slots, _attend_cache), the scan emits only the new entries as ys, and one dynamic_update_slice
    # per stack writes them after the scan (in place when the cache is donated).
    slots = cache.k.shape[3]
    read = slots if read_slots is None else int(read_slots)
    if not 0 <= read <= slots:
        raise ValueError(f"forward: read_slots={read} outside [0, {slots}]")
    # [B, P]: readable slots among the first `read` (all rows share the write cursor)
    ok = cache.valid[:, :read] & (jnp.arange(read) < cache.index)[None] if read else None

    # decode steps (few rows): with model.decode_weights=native the projections a GGUF file
    # quantized read its blocks, with model.decode_matmul=native the others read their layer in
    # place from the stacks; the scan then slices neither
    kernels = _decode_kernels(params, cfg, b * t)
    layer_params = params["layers"]
    if kernels:
        layer_params = {n: ({k: w for k, w in sub.items() if k != "kernel"} if n in kernels else sub)
                        for n, sub in layer_params.items()}

    def cached_body(x, xs):
        p, la_l, lb_l, layer = xs
        cache_in = CacheRead(cache.k, cache.v, layer, ok)
        x, p = _rows_split(x), _fsdp_gathered(p)
        p = {**p, **{n: {**p[n], "kernel": kind(w, layer)} for n, (kind, w) in kernels.items()}}
        x, (k_new, v_new) = _block(cfg, x, p, la_l, lb_l, scale, per_row, positions, cache_in, mask, seg)
        return x, (k_new.astype(cache.k.dtype), v_new.astype(cache.v.dtype))

    cached_body = _remat(cached_body, resolve_remat(remat, t))
    layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    x, (k_new, v_new) = jax.lax.scan(cached_body, x, (layer_params, la, lb, layers))
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    zero = jnp.zeros((), jnp.int32)
    at = (zero, zero, zero, cache.index, zero)                  # k_new: [layer, B, kv_heads, T, D]
    new_cache = KVCache(k=jax.lax.dynamic_update_slice(cache.k, k_new, at),
                        v=jax.lax.dynamic_update_slice(cache.v, v_new, at),
                        valid=jax.lax.dynamic_update_slice_in_dim(cache.valid, valid, cache.index, axis=1),
                        index=cache.index + t)
    return hidden, new_cache


REMAT_AUTO_LEN = 512  # remat auto (None) recomputes blocks from this row length (slots) up on CPU
# Per decoder block, what the backward pass keeps (jax.checkpoint_policies) and recomputes:
REMAT_POLICIES = {
    "none": None,                                        # keep everything (no jax.checkpoint)
    "full": jax.checkpoint_policies.nothing_saveable,    # keep the block inputs, recompute the block
    # full, but keep the native whole-row attention's output and log-sum-exp (585 floats a token at
    # SmolLM2's heads): the backward skips the attention forward; equals full under XLA's attention
    "keep_attention": jax.checkpoint_policies.save_only_these_names(*causal_attention.SAVED_NAMES),
    "dots": jax.checkpoint_policies.checkpoint_dots,     # keep every matmul output
    # keep the projections' and MLP's outputs, recompute attention (its [T, T] scores are batched dots)
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def resolve_remat(remat: bool | str | None, seq_len: int) -> str:
    """The :data:`REMAT_POLICIES` name a ``seq_len``-slot forward uses.

    ``remat``: a policy name, ``True`` (``full``), ``False`` (``none``) or ``None`` / ``"auto"``:
    ``keep_attention`` from :data:`REMAT_AUTO_LEN` slots up, else ``none`` (``keep_attention`` is
    ``full`` that keeps the native whole-row attention's outputs, so the backward does not run
    that kernel's forward again; without the kernel it is ``full``). On XLA:CPU ``full`` costs no
    time there (SmolLM2-135M, 6 x 448-slot rows: 13.6 s with, 14.3 s without: saving the
    activations is memory-bound) and the per-layer ``[rows, heads, T, T]`` attention buffers a
    backward keeps dominate memory (the reference workload planned ~100 GiB without it). On
    accelerators the learner refines ``auto`` by the compiled memory plan
    (:meth:`marft_jax.train.iteration.TeamLearner.check_update_memory`).
    """
    if remat is None or remat == "auto":
        return "keep_attention" if seq_len >= REMAT_AUTO_LEN else "none"
    if isinstance(remat, bool):
        return "full" if remat else "none"
    if remat not in REMAT_POLICIES:
        raise ValueError(f"model.remat={remat!r} is not one of {['auto', *REMAT_POLICIES]}")
    return remat


def _remat(fn, policy: str):
    return fn if policy == "none" else jax.checkpoint(fn, prevent_cse=False, policy=REMAT_POLICIES[policy])


def forward_packed(params: Params, rows: PackedRows | tuple[PackedRows, ...], *, cfg: ModelConfig,
                   lora: lora_lib.LoraStack | None = None, agent: jax.Array | int | None = None,
                   remat: bool | None = False) -> jax.Array:
    """Hidden states of packed rows, flat: ``[Σ_c R_c · T_c, H]``, class after class.

    ``rows``: one :class:`PackedRows` ``[R, T]`` or one per length class (``[R_c, T_c]``,
    :mod:`marft_jax.rl.packing`); each class is its own forward (a handful, static), so its
    attention is ``T_c²`` per row, not the longest class's. ``remat`` as :func:`resolve_remat`
    (None: per class by its row length).
    """
    if isinstance(rows, PackedRows):
        rows = (rows,)
    out = []
    for r in rows:
        seg = r.segment_ids
        hidden, _ = forward(params, r.tokens, seg > 0, cfg=cfg, positions=r.positions, lora=lora, agent=agent,
                            remat=resolve_remat(remat, r.tokens.shape[-1]), segment_ids=seg, branch_ids=r.branch_ids)
        out.append(hidden.reshape((-1, hidden.shape[-1])))
    return out[0] if len(out) == 1 else jnp.concatenate(out, axis=0)


def lm_head(params: Params, cfg: ModelConfig) -> jax.Array:
    """The output projection ``[H, vocab]`` (the transposed embedding when tied)."""
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


class Head(NamedTuple):
    """The output projection as stored: ``weight`` ``[vocab, H]`` (the tied embedding,
    ``vocab_major``) or ``[H, vocab]`` (an untied ``lm_head``). A transposed embedding handed into
    a scan is a loop input XLA cannot fold into the loop's dots: it materializes the 113 MB
    ``[H, vocab]`` copy once per scan (SmolLM2-135M), so callers keep the stored layout."""

    weight: jax.Array
    vocab_major: bool

    def logits(self, hidden: jax.Array) -> jax.Array:
        """``[..., H] -> [..., vocab]`` float32 logits (accumulated in float32)."""
        spec = "...h,vh->...v" if self.vocab_major else "...h,hv->...v"
        return jnp.einsum(spec, hidden, self.weight.astype(hidden.dtype), preferred_element_type=jnp.float32)


def output_head(params: Params, cfg: ModelConfig) -> Head:
    """The LM head in its stored layout (:class:`Head`)."""
    if cfg.tie_word_embeddings:
        return Head(params["embed"], True)
    return Head(params["lm_head"], False)


def logits_from_hidden(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """``[..., H] -> [..., vocab]`` float32 logits (accumulated in float32)."""
    head = params.get(QUANTIZED, {}).get("lm_head")
    if cfg.decode_weights == "native" and head is not None and quant_matmul.fits(hidden):
        return quant_matmul.matmul(hidden, head[None], 0)
    return output_head(params, cfg).logits(hidden)


@functools.partial(jax.jit, static_argnames=("cfg", "remat"))
def logits_fn(params: Params, tokens: jax.Array, valid: jax.Array, cfg: ModelConfig,
              lora: lora_lib.LoraStack | None = None, agent: jax.Array | None = None,
              remat: bool = False) -> jax.Array:
    """Full ``[batch, time, vocab]`` float32 logits (tests and small evaluations only)."""
    hidden, _ = forward(params, tokens, valid, cfg=cfg, lora=lora, agent=agent, remat=remat)
    return logits_from_hidden(params, cfg, hidden)
