"""Attention for training, prefill and decode: one entry point, several implementations.

``model.attention`` picks the implementation of *segment attention* (causal attention inside
segments, no KV cache: training and critic forwards over packed or padded rows, and the
sampler's prefill into an empty cache):

* ``xla``: einsum scores, boolean mask, float32 softmax (any backend; the default on CPU).
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on NVIDIA GPUs (half
  precision: chosen by ``auto`` when the weights are bf16/fp16). Segments and padding are
  passed as a boolean mask.
* ``pallas``: the Pallas flash-attention kernel JAX ships (Triton ``mha`` on GPU, the Mosaic
  ``flash_attention`` on TPU), with segment ids and ``causal=True``.
* ``splash``: Pallas splash attention on TPU (causal mask, segment ids).
* ``auto``: ``xla`` on CPU, ``cudnn`` on GPU for bf16/fp16 weights (``xla`` in float32),
  ``splash`` on TPU. The choice is logged once.

Queries against a filled KV cache (decode, continued prefill) always use the XLA
implementation over the filled slots: the cache layout is ours (``[layer, B, kv_heads, slots,
D]``, read-only inside the layer scan) and decode is bandwidth-bound on reading it.

Shapes: ``q [B, T, heads, D]``; ``k, v [B, kv_heads, S, D]`` (head-major, as the cache);
``segment_ids [B, T]`` int32 (0 = padding; a token attends to earlier tokens of its own
segment). Grouped-query attention: ``heads % kv_heads == 0``. Results ``[B, T, heads, D]``.
Outputs at padding positions are unspecified (finite); callers never read them.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATIONS = ("xla", "cudnn", "pallas", "splash")
CHOICES = ("auto",) + IMPLEMENTATIONS
_BACKENDS = {"xla": ("cpu", "gpu", "tpu"), "cudnn": ("gpu",), "pallas": ("gpu", "tpu"), "splash": ("tpu",)}
NEG = -1e30  # finite "minus infinity": fully masked (pad) query rows stay NaN-free
_log = logging.getLogger(__name__)
_logged: set = set()


class AttentionUnavailable(ValueError):
    """The requested attention implementation does not run on this backend (names the key)."""


def _backend(backend: str | None) -> str:
    b = backend or jax.default_backend()
    return "gpu" if b in ("cuda", "rocm", "gpu") else b


def resolve(requested: str, backend: str | None = None, dtype=None, *, key: str = "model.attention") -> str:
    """The implementation ``requested`` (one of :data:`CHOICES`) stands for on ``backend``.

    Raises :class:`AttentionUnavailable` naming ``key`` for an unknown name or one the backend
    lacks. ``auto`` is logged once per (backend, choice).
    """
    b = _backend(backend)
    if requested not in CHOICES:
        raise AttentionUnavailable(f"{key}={requested!r} is not one of {list(CHOICES)}")
    if requested == "auto":
        half = dtype is not None and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        impl = {"gpu": "cudnn" if half else "xla", "tpu": "splash"}.get(b, "xla")
        if (b, impl) not in _logged:
            _logged.add((b, impl))
            _log.info("%s=auto: %s on %s", key, impl, b)
        return impl
    if b not in _BACKENDS[requested]:
        ok = [i for i in IMPLEMENTATIONS if b in _BACKENDS[i]]
        raise AttentionUnavailable(f"{key}={requested!r} needs a {' or '.join(_BACKENDS[requested]).upper()} "
                                   f"backend; this one is {b!r} (available here: auto, {', '.join(ok)})")
    return requested


CAUSAL_BLOCK = 64  # query block of the blocked causal path (fastest of 64/128/256 on XLA:CPU)
_MAX_CAUSAL_BLOCKS = 32  # above this many blocks the block grows (bounded program size)


def causal_block_size(t: int) -> int:
    """Query block of :func:`xla_attention`'s blocked causal path for ``t`` queries: 64, or
    ``t / 32`` rounded up to a multiple of 64 for rows over 2,048 (at most 32 blocks)."""
    return max(CAUSAL_BLOCK, -(-(-(-t // _MAX_CAUSAL_BLOCKS)) // CAUSAL_BLOCK) * CAUSAL_BLOCK)


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                  prefix: tuple[jax.Array, jax.Array, jax.Array] | None = None, *,
                  causal: bool = False) -> jax.Array:
    """Grouped-query attention with a boolean mask, softmax in float32.

    mask: ``[B, T, S]`` (True = may attend). ``prefix``: optional read-only keys/values placed
    before ``k`` (the KV cache): ``(k_prefix [B, kv_heads, P, D], v_prefix [B, kv_heads, P, D],
    mask_prefix [B, T, P])``; one softmax runs over the ``P + S`` keys, without concatenating the
    cache (only the ``[.., P + S]`` scores are joined).

    ``causal=True`` promises that ``mask`` is causal (``T == S`` and query ``i`` never attends
    to a key ``j > i``; segment and padding masks may remove more). Without a prefix the
    queries then run in blocks of :func:`causal_block_size`, each against the keys up to its
    own end only: the score blocks above the diagonal, all masked, are never computed. That
    halves the attention's FLOPs and memory traffic at long rows (SmolLM2 shape, 4 x 864
    tokens, XLA:CPU: forward 97 -> 57 ms, forward + backward 284 -> 142 ms per layer). The
    result equals the dense path's up to float rounding (the softmax sums fewer exact zeros).
    """
    b, t, nh, d = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    block = causal_block_size(t)
    if causal and prefix is None and k.shape[2] == t and t > block:
        return _blocked_causal(q, k, v, mask, block)
    # Batch-major [B, kv_heads, group*T, D] queries: both einsums are plain batched matmuls
    # (no transposed operands or outputs), ~3x faster for decode on XLA:CPU.
    qg = group_queries(q, nkv)

    def masked_scores(keys, m):
        s = jnp.einsum("bkqd,bksd->bkqs", qg, keys, preferred_element_type=jnp.float32)
        s = s * (1.0 / np.sqrt(d))
        return jnp.where(group_mask(m, g), s, NEG)

    scores = masked_scores(k, mask)
    if prefix is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkqs,bksd->bkqd", probs, v)
    else:
        k_pre, v_pre, mask_pre = prefix
        p = k_pre.shape[2]
        probs = jax.nn.softmax(jnp.concatenate([masked_scores(k_pre, mask_pre), scores], -1), axis=-1)
        probs = probs.astype(v.dtype)
        out = (jnp.einsum("bkqs,bksd->bkqd", probs[..., :p], v_pre.astype(v.dtype))
               + jnp.einsum("bkqs,bksd->bkqd", probs[..., p:], v))
    return ungroup_queries(out, t)


def group_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """``[B, T, heads, D]`` -> ``[B, kv_heads, group·T, D]``: the query rows of each kv head
    (its ``group = heads / kv_heads`` query heads times the T tokens), head-major."""
    b, t, nh, d = q.shape
    g = nh // kv_heads
    return q.reshape(b, t, kv_heads, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, d)


def ungroup_queries(x: jax.Array, t: int) -> jax.Array:
    """Inverse of :func:`group_queries`: ``[B, kv_heads, group·T, D]`` -> ``[B, T, heads, D]``."""
    b, nkv, gt, d = x.shape
    g = gt // t
    return x.reshape(b, nkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, nkv * g, d)


def group_mask(mask: jax.Array, group: int) -> jax.Array:
    """``[B, T, S]`` -> ``[B, 1, group·T, S]``, the rows of :func:`group_queries`."""
    b, t, s = mask.shape
    return jnp.broadcast_to(mask[:, None, None], (b, 1, group, t, s)).reshape(b, 1, group * t, s)


def _query_blocks(t: int, block: int) -> list[tuple[int, int]]:
    return [(s0, min(s0 + block, t)) for s0 in range(0, t, block)]


def _block_view(x: jax.Array, s0: int, s1: int) -> jax.Array:
    """Rows ``[s0, s1)`` of a grouped ``[B, kv, g, T, ...]`` array as ``[B, kv, g·n, ...]``."""
    b, nkv, g = x.shape[:3]
    return x[:, :, :, s0:s1].reshape((b, nkv, g * (s1 - s0)) + x.shape[4:])


def _block_mask(mask: jax.Array, s0: int, s1: int, g: int) -> jax.Array:
    """``mask[:, s0:s1, :s1]`` broadcast over the ``g`` query heads of a kv head: ``[B, 1, g·n, s1]``."""
    b, n = mask.shape[0], s1 - s0
    return jnp.broadcast_to(mask[:, None, None, s0:s1, :s1], (b, 1, g, n, s1)).reshape(b, 1, g * n, s1)


def _blocked_forward(q, k, v, mask, block):
    """Grouped outputs ``[B, kv, g, T, D]`` and log-sum-exps ``[B, kv, g, T]`` (float32)."""
    b, t, nh, d = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    qg = q.reshape(b, t, nkv, g, d).transpose(0, 2, 3, 1, 4)                  # [B, kv, g, T, D]
    outs, lses = [], []
    for s0, s1 in _query_blocks(t, block):
        s = jnp.einsum("bkqd,bksd->bkqs", _block_view(qg, s0, s1), k[:, :, :s1],
                       preferred_element_type=jnp.float32) * (1.0 / np.sqrt(d))
        s = jnp.where(_block_mask(mask, s0, s1, g), s, NEG)
        top = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - top)
        total = jnp.sum(p, axis=-1, keepdims=True)
        # normalise the [n, D] output, not the [n, s1] probabilities
        o = jnp.einsum("bkqs,bksd->bkqd", p.astype(v.dtype), v[:, :, :s1], preferred_element_type=jnp.float32) / total
        outs.append(o.astype(q.dtype).reshape(b, nkv, g, s1 - s0, d))
        lses.append((top + jnp.log(total)).reshape(b, nkv, g, s1 - s0))
    return jnp.concatenate(outs, axis=3), jnp.concatenate(lses, axis=3)


def _ungroup(o: jax.Array) -> jax.Array:
    """``[B, kv, g, T, D] -> [B, T, kv·g, D]``."""
    b, nkv, g, t, d = o.shape
    return o.transpose(0, 3, 1, 2, 4).reshape(b, t, nkv * g, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blocked_causal(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, block: int) -> jax.Array:
    """:func:`xla_attention` for a causal ``mask`` without a prefix: query block ``[s0, s1)``
    attends to keys ``[0, s1)`` only (static slices, unrolled over the ``T / block`` blocks).

    A hand-written backward (the flash-attention one: recompute each block's probabilities
    from the saved log-sum-exp; ``dS = P ⊙ (dP − rowsum(dO ⊙ O))``) instead of autodiff of the
    softmax: inside the remat'd layer scan it is ~2.2x faster on XLA:CPU (SmolLM2 shape, 4 x
    1,504-token rows, 6 layers: attention's share of the gradient 6.7 s -> 3.0 s). Fully masked
    (padding) queries get no gradient; their outputs are unspecified anyway.
    """
    return _ungroup(_blocked_forward(q, k, v, mask, block)[0])


def _blocked_causal_fwd(q, k, v, mask, block):
    o, lse = _blocked_forward(q, k, v, mask, block)
    return _ungroup(o), (q, k, v, mask, o, lse)


def _blocked_causal_bwd(block, res, d_out):
    q, k, v, mask, o, lse = res
    b, t, nh, d = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    scale = 1.0 / np.sqrt(d)
    f32 = lambda x: x.astype(jnp.float32)
    qg = q.reshape(b, t, nkv, g, d).transpose(0, 2, 3, 1, 4)
    dog = d_out.reshape(b, t, nkv, g, d).transpose(0, 2, 3, 1, 4)
    delta = jnp.sum(f32(dog) * f32(o), axis=-1)                                # [B, kv, g, T]
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    dqs = []
    for s0, s1 in _query_blocks(t, block):
        qb, dob = _block_view(qg, s0, s1), _block_view(dog, s0, s1)
        kb, vb = k[:, :, :s1], v[:, :, :s1]
        s = jnp.einsum("bkqd,bksd->bkqs", qb, kb, preferred_element_type=jnp.float32) * scale
        p = jnp.where(_block_mask(mask, s0, s1, g), jnp.exp(s - _block_view(lse, s0, s1)[..., None]), 0.0)
        dp = jnp.einsum("bkqd,bksd->bkqs", dob, vb, preferred_element_type=jnp.float32)
        ds = p * (dp - _block_view(delta, s0, s1)[..., None])
        dqs.append((jnp.einsum("bkqs,bksd->bkqd", ds, f32(kb)) * scale).reshape(b, nkv, g, s1 - s0, d))
        dk = dk.at[:, :, :s1].add(jnp.einsum("bkqs,bkqd->bksd", ds, f32(qb)) * scale)
        dv = dv.at[:, :, :s1].add(jnp.einsum("bkqs,bkqd->bksd", p, f32(dob)))
    dq = _ungroup(jnp.concatenate(dqs, axis=3))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_blocked_causal.defvjp(_blocked_causal_fwd, _blocked_causal_bwd)


def segment_mask(segment_ids: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """``[B, T, T]`` bool: causal, same segment, key not padding (``valid`` defaults to
    ``segment_ids > 0``)."""
    t = segment_ids.shape[-1]
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    keys = segment_ids > 0 if valid is None else valid
    return keys[:, None, :] & causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])


def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, impl: str = "xla",
                      interpret: bool = False, dpa_implementation: str | None = "cudnn",
                      mask: jax.Array | None = None) -> jax.Array:
    """Causal attention inside segments (no cache) with implementation ``impl``.

    ``mask``: an explicit causal ``[B, T, T]`` mask that replaces the segment one (shared-prefix
    branches, :mod:`marft_jax.rl.packing`); only ``xla`` and ``cudnn`` take one (the Pallas
    kernels know segment ids only: :class:`AttentionUnavailable`, naming ``ppo.share_prefixes``).

    ``interpret`` runs the Pallas kernels in interpret mode (CPU tests); ``dpa_implementation``
    is what ``cudnn`` passes to ``jax.nn.dot_product_attention`` (tests use ``"xla"`` to check
    the layout and mask conversion on CPU). The same two hooks can ride on ``impl`` (and so on
    ``ModelConfig.attention``, for whole-decoder tests): ``"pallas:interpret"``, ``"cudnn:xla"``.
    """
    impl, _, flavour = impl.partition(":")   # test hooks: "pallas:interpret", "cudnn:xla" (CPU)
    interpret = interpret or flavour == "interpret"
    if flavour == "xla":
        dpa_implementation = "xla"
    d = q.shape[-1]
    scale = 1.0 / float(np.sqrt(d))
    if impl == "xla":
        return xla_attention(q, k, v, segment_mask(segment_ids) if mask is None else mask, causal=True)
    if impl == "cudnn":
        mask = (segment_mask(segment_ids) if mask is None else mask)[:, None]      # [B, 1, T, T]
        out = jax.nn.dot_product_attention(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), mask=mask,
                                           scale=scale, implementation=dpa_implementation)
        return out.astype(q.dtype)
    if mask is not None:
        raise AttentionUnavailable(f"model.attention={impl!r} takes segment ids only, not the shared-prefix mask: "
                                   "set ppo.share_prefixes=false or model.attention=xla/cudnn")
    groups = q.shape[2] // k.shape[1]
    kh = jnp.repeat(k, groups, axis=1)                                           # [B, heads, S, D]
    vh = jnp.repeat(v, groups, axis=1)
    if impl == "pallas" and (interpret or _backend(None) == "gpu"):
        from jax.experimental.pallas.ops.gpu import attention as gpu_attention

        return gpu_attention.mha(q, jnp.swapaxes(kh, 1, 2), jnp.swapaxes(vh, 1, 2), segment_ids=segment_ids,
                                 sm_scale=scale, causal=True, interpret=interpret)
    if impl == "pallas":
        from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

        out = tpu_flash.flash_attention(jnp.swapaxes(q, 1, 2), kh, vh,
                                        segment_ids=tpu_flash.SegmentIds(q=segment_ids, kv=segment_ids),
                                        causal=True, sm_scale=scale)
        return jnp.swapaxes(out, 1, 2)
    if impl == "splash":
        return _splash(q, kh, vh, segment_ids, scale, interpret)
    raise AttentionUnavailable(f"model.attention={impl!r} is not one of {list(IMPLEMENTATIONS)}")


def _splash(q, kh, vh, segment_ids, scale, interpret):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

    b, t, nh, _ = q.shape
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((t, t)) for _ in range(nh)])
    block = min(512, t)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    kernel = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret)
    qh = jnp.swapaxes(q, 1, 2) * jnp.asarray(scale, q.dtype)                    # splash does not scale
    out = jax.vmap(lambda qq, kk, vv, s: kernel(qq, kk, vv, segment_ids=splash.SegmentIds(q=s, kv=s)))(
        qh, kh, vh, segment_ids)
    return jnp.swapaxes(out, 1, 2)
