"""Attention for training, prefill and decode: one entry point, several implementations.

``model.attention`` picks the implementation of *segment attention* (causal attention inside
segments, no KV cache: training and critic forwards over packed or padded rows, and the
sampler's prefill into an empty cache):

* ``xla``: einsum scores, boolean mask, float32 softmax (any backend; the default on CPU).
  On one CPU device in float32, ``model.causal_attention`` (default ``auto``) runs these whole
  rows in a native kernel instead (:mod:`marft_jax.models.causal_attention`; the decoder routes).
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on NVIDIA GPUs (half
  precision only: chosen by ``auto`` when the weights are bf16/fp16, refused by :func:`resolve`
  for float32 weights), ``is_causal=True`` (the blocks above the diagonal are skipped) plus the
  segment mask for segments and padding (JAX 0.10's public API offers only right-padding
  lengths, which packed or left-padded rows do not fit).
* ``pallas``: the Pallas flash-attention kernel JAX ships (Triton ``mha`` when lowered for a
  GPU, the Mosaic ``flash_attention`` for a TPU), with segment ids and ``causal=True``.
* ``splash``: Pallas splash attention on TPU (causal mask, segment ids, native grouped-query).
* ``auto``: ``xla`` on CPU, ``cudnn`` on GPU for bf16/fp16 weights (``xla`` in float32),
  ``splash`` on TPU. The choice is logged once.

Queries against a filled KV cache (decode, continued prefill) always use the XLA
implementation over the filled slots: the cache layout is ours (``[layer, B, kv_heads, slots,
D]``, read-only inside the layer scan) and decode is bandwidth-bound on reading it.

Every kernel takes any row length: :func:`segment_attention` pads rows to
:func:`kernel_length` and slices the result; on a mesh it runs the kernels under ``shard_map``
(rows over ``data`` x ``fsdp``, heads over ``tensor``). What each kernel accepts:

==========  ==========================  =====================================  ===================
kernel      platform                    padded row length (from T)             blocks
==========  ==========================  =====================================  ===================
xla         any                         T                                      :func:`causal_block_size`
cudnn       GPU (cuDNN)                 T rounded up to even                   cuDNN's
pallas_gpu  GPU (Triton ``mha``)        next power of 2 >= 16 up to 128,       fwd min(128, T),
                                        else a multiple of 128                 bwd min(32, T)
pallas_tpu  TPU (Mosaic flash)          a multiple of 128                      :func:`tpu_block`
splash      TPU (Mosaic splash)         a multiple of 128                      :func:`tpu_block`
==========  ==========================  =====================================  ===================

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

    ``dtype``: the dtype the weights load in (``None``: unknown). Raises
    :class:`AttentionUnavailable` naming ``key`` for an unknown name, one the backend lacks, or
    ``cudnn`` with a known dtype that is not bf16/fp16 (naming ``model.dtype``). ``auto`` is
    logged once per (backend, choice).
    """
    b = _backend(backend)
    if requested not in CHOICES:
        raise AttentionUnavailable(f"{key}={requested!r} is not one of {list(CHOICES)}")
    half = dtype is not None and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if requested == "auto":
        impl = {"gpu": "cudnn" if half else "xla", "tpu": "splash"}.get(b, "xla")
        if (b, impl) not in _logged:
            _logged.add((b, impl))
            _log.info("%s=auto: %s on %s", key, impl, b)
        return impl
    if b not in _BACKENDS[requested]:
        ok = [i for i in IMPLEMENTATIONS if b in _BACKENDS[i]]
        raise AttentionUnavailable(f"{key}={requested!r} needs a {' or '.join(_BACKENDS[requested]).upper()} "
                                   f"backend; this one is {b!r} (available here: auto, {', '.join(ok)})")
    if requested == "cudnn" and dtype is not None and not half:
        raise AttentionUnavailable(f"{key}='cudnn' needs bfloat16 or float16 weights (cuDNN flash attention is half "
                                   f"precision), but model.dtype gives {jnp.dtype(dtype).name}: set "
                                   "model.dtype=bfloat16 or auto, or model.attention=auto/xla")
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


KERNELS = ("xla", "cudnn", "pallas_gpu", "pallas_tpu", "splash")
_TPU_BLOCKS = (512, 256, 128)


def kernel_name(impl: str, platform: str | None = None) -> str:
    """The kernel (one of :data:`KERNELS`) that ``impl`` runs on ``platform``.

    ``impl``: a :data:`KERNELS` name, an implementation name or one with a test hook
    (``"pallas:interpret"`` is the GPU kernel, ``"pallas:tpu_interpret"`` the TPU one).
    ``platform`` (``gpu``/``cuda``/``rocm``/``tpu``; default: the default backend) only matters
    for ``pallas``. Raises ``ValueError`` for an unknown name, or ``pallas`` on another platform.
    """
    base, _, flavour = impl.partition(":")
    if base in KERNELS and base != "pallas":
        return base
    if base != "pallas":
        raise ValueError(f"unknown attention implementation {impl!r} (kernels: {list(KERNELS)})")
    if flavour == "interpret":
        return "pallas_gpu"
    if flavour == "tpu_interpret":
        return "pallas_tpu"
    b = _backend(platform)
    if b not in ("gpu", "tpu"):
        raise ValueError(f"{impl!r} runs the Triton kernel on a GPU and the Mosaic one on a TPU: name the platform "
                         f"(this one is {b!r})")
    return "pallas_gpu" if b == "gpu" else "pallas_tpu"


def kernel_length(impl: str, t: int, platform: str | None = None) -> int:
    """The row length :func:`segment_attention` pads a row of ``t`` tokens to for ``impl`` on
    ``platform`` (see :func:`kernel_name`); the module docstring's table lists the rules. ``t >= 1``."""
    kernel = kernel_name(impl, platform)
    if kernel == "xla":
        return t
    if kernel == "cudnn":
        return t + t % 2
    if kernel == "pallas_gpu":
        return max(16, 1 << (t - 1).bit_length()) if t <= 128 else -(-t // 128) * 128
    return max(128, -(-t // 128) * 128)


def tpu_block(t_padded: int) -> int:
    """The block (every phase, queries and keys) of the TPU kernels for a padded row: the largest
    of 512/256/128 that divides it."""
    return next(b for b in _TPU_BLOCKS if t_padded % b == 0)


def _pad_axis(x: jax.Array, axis: int, n: int, value=0) -> jax.Array:
    """``x`` padded at the end of ``axis`` to length ``n`` with ``value``."""
    if x.shape[axis] == n:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


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

    Any row length works: the kernels get rows padded to :func:`kernel_length` (segment id 0,
    sliced off again). Inside a ``jax.set_mesh`` context of more than one device every kernel but
    ``xla`` runs under ``shard_map`` (Mosaic and Triton calls cannot be partitioned
    automatically): rows split over ``data`` x ``fsdp``, query and kv heads over ``tensor``
    (each replicated where the axis does not divide it). ``pallas`` is the Triton kernel when
    lowered for CUDA/ROCm and the Mosaic one when lowered for TPU (``lax.platform_dependent``,
    so a CPU host lowers either).

    ``mask``: an explicit causal ``[B, T, T]`` mask that replaces the segment one (shared-prefix
    branches, :mod:`marft_jax.rl.packing`); only ``xla`` and ``cudnn`` take one (the Pallas
    kernels know segment ids only: :class:`AttentionUnavailable`, naming ``ppo.share_prefixes``).

    ``interpret`` runs the Pallas kernels in interpret mode (CPU tests); ``dpa_implementation``
    is what ``cudnn`` passes to ``jax.nn.dot_product_attention`` (tests use ``"xla"`` to check
    the layout and mask conversion on CPU). The same hooks can ride on ``impl`` (and so on
    ``ModelConfig.attention``, for whole-decoder tests): ``"pallas:interpret"`` (Triton),
    ``"pallas:tpu_interpret"`` (Mosaic flash, traced under ``pltpu.force_tpu_interpret_mode``;
    trace a gradient under it too), ``"splash:interpret"``, ``"cudnn:xla"``.
    """
    impl, _, flavour = impl.partition(":")   # test hooks (CPU)
    interpret = interpret or flavour == "interpret"
    if flavour == "xla":
        dpa_implementation = "xla"
    scale = 1.0 / float(np.sqrt(q.shape[-1]))
    if impl == "xla":
        return xla_attention(q, k, v, segment_mask(segment_ids) if mask is None else mask, causal=True)
    if impl not in IMPLEMENTATIONS:
        raise AttentionUnavailable(f"model.attention={impl!r} is not one of {list(IMPLEMENTATIONS)}")
    if mask is not None and impl != "cudnn":
        raise AttentionUnavailable(f"model.attention={impl!r} takes segment ids only, not the shared-prefix mask: "
                                   "set ppo.share_prefixes=false or model.attention=xla/cudnn")
    if impl == "cudnn":
        kernel = functools.partial(_cudnn, scale=scale, implementation=dpa_implementation)
    elif impl == "splash":
        kernel = functools.partial(_splash, scale=scale, interpret=interpret)
    elif interpret:
        kernel = functools.partial(_pallas_gpu, scale=scale, interpret=True)
    elif flavour == "tpu_interpret":
        from jax.experimental.pallas import tpu as pltpu

        with pltpu.force_tpu_interpret_mode():
            return _on_mesh(functools.partial(_pallas_tpu, scale=scale), q, k, v, segment_ids)
    else:
        gpu = functools.partial(_pallas_gpu, scale=scale, interpret=False)
        tpu = functools.partial(_pallas_tpu, scale=scale)
        kernel = lambda *a: jax.lax.platform_dependent(*a, cuda=gpu, rocm=gpu, tpu=tpu)
    return _on_mesh(kernel, q, k, v, segment_ids, mask)


def _on_mesh(kernel, q, k, v, segment_ids, mask=None):
    """``kernel(q, k, v, segment_ids[, mask])`` per device under ``shard_map`` over the context
    mesh (rows over ``data`` x ``fsdp``, heads over ``tensor``); called directly without a mesh
    or on one device."""
    mesh = jax.sharding.get_abstract_mesh()
    args = (q, k, v, segment_ids) + (() if mask is None else (mask,))
    free = [] if mesh.empty else [a for a in mesh.axis_names if a not in mesh.manual_axes]
    if mesh.empty or mesh.size == 1 or not free:        # no mesh, one device, or already per device
        return kernel(*args)
    rows = tuple(a for a in ("data", "fsdp") if a in free and mesh.shape[a] > 1)
    if q.shape[0] % int(np.prod([mesh.shape[a] for a in rows], dtype=int)):
        rows = ()                                         # rows not divisible: replicated
    tp = mesh.shape["tensor"] if "tensor" in free else 1
    heads = "tensor" if tp > 1 and q.shape[2] % tp == 0 and k.shape[1] % tp == 0 else None
    r = rows if len(rows) > 1 else (rows[0] if rows else None)
    P = jax.sharding.PartitionSpec
    specs = (P(r, None, heads, None), P(r, heads, None, None), P(r, heads, None, None), P(r, None))
    specs += () if mask is None else (P(r, None, None),)
    return jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=P(r, None, heads, None),
                         axis_names=set(free), check_vma=False)(*args)


def _pallas_gpu(q, k, v, segment_ids, *, scale, interpret):
    """JAX's Pallas Triton flash kernel (``ops.gpu.attention.mha``). The kernel has no
    grouped-query support (q, k and v share one head count), so K/V are repeated to the query
    heads here (``group`` x their traffic)."""
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    t = q.shape[1]
    n = kernel_length("pallas_gpu", t)
    group = q.shape[2] // k.shape[1]
    kh = _pad_axis(jnp.swapaxes(jnp.repeat(k, group, axis=1), 1, 2), 1, n)      # [B, n, heads, D]
    vh = _pad_axis(jnp.swapaxes(jnp.repeat(v, group, axis=1), 1, 2), 1, n)
    out = gpu_attention.mha(_pad_axis(q, 1, n), kh, vh, segment_ids=_pad_axis(segment_ids, 1, n), sm_scale=scale,
                            causal=True, interpret=interpret)
    return out[:, :t]


def _pallas_tpu(q, k, v, segment_ids, *, scale):
    """JAX's Pallas Mosaic flash kernel (``ops.tpu.flash_attention``). The kernel has no
    grouped-query support (q, k and v share one head count), so K/V are repeated to the query
    heads here (``group`` x their traffic; ``splash`` avoids that). Head dims over 128 must be
    multiples of 128 (the kernel's rule)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

    t = q.shape[1]
    n = kernel_length("pallas_tpu", t)
    blk = tpu_block(n)
    sizes = tpu_flash.BlockSizes(block_q=blk, block_k_major=blk, block_k=blk, block_b=1,
                                 block_q_major_dkv=blk, block_k_major_dkv=blk, block_k_dkv=blk, block_q_dkv=blk,
                                 block_k_major_dq=blk, block_k_dq=blk, block_q_dq=blk)
    group = q.shape[2] // k.shape[1]
    kh = _pad_axis(jnp.repeat(k, group, axis=1), 2, n)                           # [B, heads, n, D]
    vh = _pad_axis(jnp.repeat(v, group, axis=1), 2, n)
    seg = _pad_axis(segment_ids, 1, n)
    out = tpu_flash.flash_attention(_pad_axis(jnp.swapaxes(q, 1, 2), 2, n), kh, vh,
                                    segment_ids=tpu_flash.SegmentIds(q=seg, kv=seg), causal=True, sm_scale=scale,
                                    block_sizes=sizes)
    return jnp.swapaxes(out[:, :, :t], 1, 2)


def _splash(q, k, v, segment_ids, *, scale, interpret):
    """Pallas splash attention (TPU), grouped-query natively: query head ``h`` reads kv head
    ``h // group`` inside the kernel (``make_splash_mha`` with fewer kv heads; one kv head:
    ``make_splash_mqa``), K/V are never repeated. Splash takes a static mask (here causal) plus
    segment ids, nothing per row: shared-prefix branches cannot be expressed."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

    _, t, nh, _ = q.shape
    nkv = k.shape[1]
    n = kernel_length("splash", t)
    blk = tpu_block(n)
    causal = splash_mask.MultiHeadMask([splash_mask.CausalMask((n, n)) for _ in range(nh)])
    sizes = splash.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk, block_kv_dkv=blk,
                              block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk)
    make = splash.make_splash_mqa if nkv == 1 else splash.make_splash_mha
    kernel = make(causal, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret)
    qh = _pad_axis(jnp.swapaxes(q, 1, 2) * jnp.asarray(scale, q.dtype), 2, n)    # splash does not scale
    kp, vp = _pad_axis(k, 2, n), _pad_axis(v, 2, n)
    if nkv == 1:
        kp, vp = kp[:, 0], vp[:, 0]
    out = jax.vmap(lambda qq, kk, vv, s: kernel(qq, kk, vv, segment_ids=splash.SegmentIds(q=s, kv=s)))(
        qh, kp, vp, _pad_axis(segment_ids, 1, n))
    return jnp.swapaxes(out[:, :, :t], 1, 2)


def _cudnn(q, k, v, segment_ids, mask=None, *, scale, implementation):
    """``jax.nn.dot_product_attention`` with ``is_causal=True`` (cuDNN skips the blocks above
    the diagonal) and the segment mask (``mask`` when given) for what causality leaves, on rows
    padded to an even length (cuDNN refuses odd lengths with a bias in training). Vmapped
    axes (agents) are folded into the batch before cuDNN (:func:`_cudnn_call`)."""
    t = q.shape[1]
    n = kernel_length("cudnn", t)
    m = segment_mask(segment_ids) if mask is None else mask
    m = _pad_axis(_pad_axis(m, 1, n, False), 2, n, False)[:, None]             # [B, 1, n, n]
    kt = _pad_axis(jnp.swapaxes(k, 1, 2), 1, n)                                 # [B, n, kv_heads, D]
    vt = _pad_axis(jnp.swapaxes(v, 1, 2), 1, n)
    out = _cudnn_call(_pad_axis(q, 1, n), kt, vt, m, scale, implementation)
    return out[:, :t].astype(q.dtype)


def _dpa(q, k, v, mask, scale, implementation):
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True,
                                        implementation=implementation)


def _batch_folded(fn):
    """``fn`` (arrays with a leading batch axis in, a pytree of such arrays out) under
    ``custom_vmap``: a vmapped axis is folded into the batch axis (an unmapped argument is
    broadcast first) instead of reaching JAX's cuDNN batching rule, which cannot reshape a
    ``[A, B, 1, T, S]`` mask (issue 37). Nested vmaps fold one after the other."""
    folded = jax.custom_batching.custom_vmap(fn)

    @folded.def_vmap
    def rule(axis_size, in_batched, *args):
        args = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip(args, in_batched)]
        out = folded(*[a.reshape((-1,) + a.shape[2:]) for a in args])
        return (jax.tree.map(lambda o: o.reshape((axis_size, -1) + o.shape[1:]), out),
                jax.tree.map(lambda _: True, out))
    return folded


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _cudnn_call(q, k, v, mask, scale, implementation):
    """:func:`_dpa` with every vmapped axis folded into the batch, forward and backward.

    ``custom_vmap`` has no reverse mode, so the gradient is this ``custom_vjp`` whose backward
    is a second folded function: ``jax.vjp`` of :func:`_dpa`, i.e. cuDNN's training forward (for
    its softmax statistics, which JAX's public API cannot hand to cuDNN's backward) and backward.
    Only the inputs are saved. Cost: one more attention forward per gradient than cuDNN's own
    VJP (3 forwards + 1 backward under the decoder's remat instead of 2 + 1). The fold has to be
    a primitive in the jaxpr (not a trace-time test for vmap): the layer scan and remat trace
    their bodies first and are batched afterwards.
    """
    return _batch_folded(functools.partial(_dpa, scale=scale, implementation=implementation))(q, k, v, mask)


def _cudnn_call_fwd(q, k, v, mask, scale, implementation):
    out = _batch_folded(functools.partial(_dpa, scale=scale, implementation=implementation))(q, k, v, mask)
    return out, (q, k, v, mask)


def _cudnn_call_bwd(scale, implementation, res, d_out):
    def grads(q, k, v, mask, d_out):
        return jax.vjp(lambda q, k, v: _dpa(q, k, v, mask, scale, implementation), q, k, v)[1](d_out)

    return (*_batch_folded(grads)(*res, d_out), None)


_cudnn_call.defvjp(_cudnn_call_fwd, _cudnn_call_bwd)
