"""Causal attention over whole rows on the CPU: a native kernel (XLA FFI), forward and backward.

The training passes, the critic-feature forward and prefills into an empty cache attend within
whole rows (:func:`marft_jax.models.attention.segment_attention`). On XLA:CPU the blocked causal
path of :func:`~marft_jax.models.attention.xla_attention` runs as many small dots against copied
key slices with single-threaded softmax passes between them; :func:`attend` hands the whole
layer to ``causal_attention_kernel.cc`` instead (register-blocked scores and weighted sums, the
masked softmax in between, key blocks no query of a block may see skipped, tasks over the
intra-op threads) and differentiates it with the kernel's flash-attention backward. The result
equals the XLA path's up to float rounding.

Selected by ``model.attention`` (``native``; ``auto`` picks it on a single CPU device in float32
when the kernel builds: :func:`marft_jax.models.attention.resolve`). One device (the call is
not partitioned), float32, head width a multiple of 16.

The library is built lazily with the system C++ compiler (:mod:`marft_jax.native_build`);
nothing raises at import. :func:`status` reports why it is unavailable.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
import numpy as np

from marft_jax import native_build

SOURCE = Path(__file__).with_name("causal_attention_kernel.cc")
# No -ffast-math: the kernel vectorizes without it (its own exponential), and a shared library
# linked with it sets flush-to-zero for the whole process when loaded (GCC < 13).
FLAGS = native_build.BASE_FLAGS
FORWARD, BACKWARD = "marft_causal_attention_fwd", "marft_causal_attention_bwd"
ROW_MULTIPLE = 16     # the kernel's rows are padded to a multiple of this (keys read 16 at a time)
# Segments of a packed row that start at multiples of this are separate tasks of the backward
# (the queries of one 4-query block belong to one task).
SEGMENT_ALIGN = 4
# The forward's output and log-sum-exp, named for remat policies (model.remat=keep_attention keeps
# them, so a rematerialized block's backward does not run the attention forward again).
SAVED_NAMES = ("causal_attention_out", "causal_attention_lse")

_library = native_build.Library(SOURCE, FLAGS, {FORWARD: "MarftCausalAttentionFwd",
                                                BACKWARD: "MarftCausalAttentionBwd"})


def status() -> native_build.Status:
    """Builds (or finds cached), loads and registers the kernels once per process."""
    return _library.status()


def resolve(requested: str, *, backend: str | None = None, dtype=None, devices: int | None = None,
            key: str = "model.causal_attention") -> str:
    """``xla`` or ``native`` for ``requested`` (``auto`` | ``xla`` | ``native``): ``auto`` is
    ``native`` on a single CPU device in float32 with AVX2 + FMA or AVX-512 when the kernel
    builds, else ``xla`` (the kernel's portable body runs slower than XLA: docs/benchmarks.md);
    ``native`` where it cannot run raises ``ValueError`` naming ``key`` and why
    (:func:`marft_jax.native_build.resolve_cpu_kernel`). A head width that is not a multiple of
    16 runs the XLA path whatever this says (:func:`supports`)."""
    impl = native_build.resolve_cpu_kernel(requested, _library, key=key, backend=backend, dtype=dtype,
                                           devices=devices)
    return "xla" if requested == "auto" and impl == "native" and not vector_units() else impl


def vector_units() -> bool:
    """Whether this CPU has the kernel's fast bodies (AVX-512F, or AVX2 with FMA: Linux's
    ``/proc/cpuinfo`` flags; False where they cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512f" in flags or ("avx2" in flags and "fma" in flags)


def supports(head_dim: int) -> bool:
    """Whether the kernel takes heads of width ``head_dim`` (a multiple of 16)."""
    return head_dim % 16 == 0


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query causal attention of a whole row; differentiable in ``q``, ``k``, ``v``.

    Args:
      q: ``[B, T, heads, D]``.
      k, v: ``[B, kv_heads, T, D]`` (head-major, as the cache).
      mask: ``[B, T, T]`` bool, query ``t`` may attend to key ``j``; causal (``j <= t`` only).
    Returns:
      ``[B, T, heads, D]`` in ``q``'s dtype (computed in float32). Rows whose queries may see no
      key get zeros (outputs at padding are unspecified for every implementation).
    """
    st = status()
    if not st.available:
        raise RuntimeError(f"model.attention=native: the kernel is unavailable: {st.reason}")
    b, t, nh, d = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    if not supports(d):
        raise ValueError(f"model.attention=native needs a head width that is a multiple of 16, got {d}")
    tp = -(-t // ROW_MULTIPLE) * ROW_MULTIPLE
    f32 = jnp.float32
    qg = q.astype(f32).reshape(b, t, nkv, g, d).transpose(0, 2, 3, 1, 4) * (1.0 / np.sqrt(d))
    pad = tp - t
    if pad:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0)))
        k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
        mask = jnp.pad(mask, ((0, 0), (0, pad), (0, pad)))
    o = _attend(qg, k.astype(f32), v.astype(f32), mask.astype(bool))
    return o[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, nh, d).astype(q.dtype)


def _forward_call(qg, k, v, mask):
    b, nkv, g, t, d = qg.shape
    shapes = (jax.ShapeDtypeStruct(qg.shape, jnp.float32), jax.ShapeDtypeStruct((b, nkv, g, t), jnp.float32))
    return jax.ffi.ffi_call(FORWARD, shapes, vmap_method="sequential")(qg, jnp.swapaxes(k, 2, 3), v, mask)


@jax.custom_vjp
def _attend(qg, k, v, mask):
    """``qg [B, KV, G, T, D]`` (scaled), ``k, v [B, KV, T, D]``, ``mask [B, T, T]`` -> ``o`` like ``qg``."""
    return _forward_call(qg, k, v, mask)[0]


def _attend_fwd(qg, k, v, mask):
    o, lse = _forward_call(qg, k, v, mask)
    o, lse = checkpoint_name(o, SAVED_NAMES[0]), checkpoint_name(lse, SAVED_NAMES[1])
    return o, (qg, k, v, mask, o, lse)


def _attend_bwd(res, d_out):
    qg, k, v, mask, o, lse = res
    shapes = (jax.ShapeDtypeStruct(qg.shape, jnp.float32),) * 3
    dq, dk_heads, dv_heads = jax.ffi.ffi_call(BACKWARD, shapes, vmap_method="sequential")(
        qg, jnp.swapaxes(k, 2, 3), k, jnp.swapaxes(v, 2, 3), mask, o, lse, d_out.astype(jnp.float32))
    # each query head of a group wrote its own share of the kv head's gradient
    return dq, dk_heads.sum(axis=2), dv_heads.sum(axis=2), None


_attend.defvjp(_attend_fwd, _attend_bwd)
