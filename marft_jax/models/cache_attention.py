"""Decode attention that reads the stacked KV cache in place: a native CPU kernel (XLA FFI).

In the decoder's layer scan XLA:CPU copies each layer's ``[B, kv_heads, P, D]`` key and value
slice out of the ``[layer, B, kv_heads, slots, D]`` cache before attending to it (a
dynamic-slice fusion per stack and layer). :func:`attend` instead hands the whole cache and the
layer index to ``cache_attention_kernel.cc``, which reads that layer's first ``P`` slots where
they lie and returns the softmax partials over them; the new tokens' own keys are folded in
here with an exact log-sum-exp merge. The result equals :func:`marft_jax.models.attention.xla_attention`
with a prefix up to float rounding.

Selected by ``model.decode_attention`` (``auto``: ``native`` on a single CPU device in
float32 when the kernel builds, else ``xla``; see :func:`resolve`). Forward only (the cache
path is never differentiated), one device (the call is not partitioned), float32.

The library is built lazily with the system C++ compiler (:mod:`marft_jax.native_build`);
nothing raises at import. :func:`status` reports why it is unavailable.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax import native_build
from marft_jax.models import attention as attention_lib

SOURCE = Path(__file__).with_name("cache_attention_kernel.cc")
# -ffast-math: the dot products and expf vectorize (the kernel has no infinities or NaNs of its own)
FLAGS = native_build.BASE_FLAGS + ("-ffast-math",)
TARGET, SYMBOL = "marft_cache_attention", "MarftCacheAttention"
CHOICES = native_build.CHOICES


_library = native_build.Library(SOURCE, FLAGS, {TARGET: SYMBOL})


def status() -> native_build.Status:
    """Builds (or finds cached), loads and registers the kernel once per process."""
    return _library.status()


def resolve(requested: str, *, backend: str | None = None, dtype=None, devices: int | None = None,
            key: str = "model.decode_attention") -> str:
    """``xla`` or ``native`` for ``requested`` (one of :data:`CHOICES`): ``auto`` is ``native`` on a
    single CPU device in float32 when the kernel builds, else ``xla``; ``native`` where it cannot
    run raises ``ValueError`` naming ``key`` and why (:func:`marft_jax.native_build.resolve_cpu_kernel`)."""
    return native_build.resolve_cpu_kernel(requested, _library, key=key, backend=backend, dtype=dtype,
                                           devices=devices)


def attend(q: jax.Array, k_new: jax.Array, v_new: jax.Array, new_mask: jax.Array, k_cache: jax.Array,
           v_cache: jax.Array, layer: jax.Array, cache_ok: jax.Array) -> jax.Array:
    """Grouped-query attention of new tokens over cache layer ``layer`` plus their own keys.

    Args:
      q: ``[B, T, heads, D]`` queries of the new tokens (float32).
      k_new, v_new: ``[B, kv_heads, T, D]`` their keys and values.
      new_mask: ``[B, T, T]`` bool, query may attend to new key (causal and valid).
      k_cache, v_cache: ``[layer, B, kv_heads, slots, D]`` float32, the whole stacked cache.
      layer: int32 scalar, the layer to read.
      cache_ok: ``[B, P]`` bool, cache slot readable (``P <= slots``: only the first ``P``
        slots are read); every query of a row sees the same slots.
    Returns:
      ``[B, T, heads, D]`` in ``q``'s dtype.
    """
    b, t, nh, d = q.shape
    nkv = k_new.shape[1]
    g = nh // nkv
    if k_cache.dtype != jnp.float32 or v_cache.dtype != jnp.float32:
        raise ValueError(f"cache_attention.attend: the native kernel reads a float32 cache, got {k_cache.dtype}")
    f32 = jnp.float32
    qg = attention_lib.group_queries(q.astype(f32), nkv) * (1.0 / np.sqrt(d))      # [B, kv, g*T, D]
    rows = qg.shape[2]
    shapes = (jax.ShapeDtypeStruct((b, nkv, rows), f32), jax.ShapeDtypeStruct((b, nkv, rows), f32),
              jax.ShapeDtypeStruct((b, nkv, rows, d), f32))
    m, l, acc = jax.ffi.ffi_call(TARGET, shapes, vmap_method="sequential")(
        qg, k_cache, v_cache, cache_ok.astype(bool), jnp.asarray(layer, jnp.int32))
    # the new keys, merged into the cached slots' partial softmax (log-sum-exp)
    s = jnp.einsum("bkqd,bksd->bkqs", qg, k_new.astype(f32))                       # [B, kv, g*T, T]
    s = jnp.where(attention_lib.group_mask(new_mask, g), s, attention_lib.NEG)
    top = jnp.maximum(m, s.max(-1))
    a = jnp.exp(m - top)
    e = jnp.exp(s - top[..., None])
    out = (acc * a[..., None] + jnp.einsum("bkqs,bksd->bkqd", e, v_new.astype(f32))) / (l * a + e.sum(-1))[..., None]
    return attention_lib.ungroup_queries(out, t).astype(q.dtype)
