"""A decode step's projections read in place from the stacked weights: a native CPU kernel (XLA FFI).

In the decoder's layer scan XLA:CPU copies each layer's ``[K, N]`` weight slice out of the
``[layer, K, N]`` stack before its dot (a dynamic-slice fusion per weight and layer; unrolling
the scan leaves a static-slice copy instead). A decode step of a few rows is bound by reading
the weights, so the copy roughly doubles the bytes it moves. :func:`matmul` hands the whole
stack and the layer index to ``layer_matmul_kernel.cc``, which streams that layer's block once,
split over the caller and XLA's intra-op threads. The result equals ``x @ w[layer]`` up to the
summation order (float32 rounding).

Selected by ``model.decode_matmul`` (``auto``: ``native`` on a single CPU device in float32 when
the kernel builds, else ``xla``; see :func:`resolve`) for calls of at most :data:`MAX_ROWS`
rows (decode steps; a prefill's many rows amortize the copy and stay with XLA's GEMM). Forward
only (the cache path is never differentiated), one device (the call is not partitioned).

The library is built lazily with the system C++ compiler (:mod:`marft_jax.native_build`);
nothing raises at import. :func:`status` reports why it is unavailable.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from marft_jax import native_build

SOURCE = Path(__file__).with_name("layer_matmul_kernel.cc")
FLAGS = native_build.BASE_FLAGS
TARGET, SYMBOL = "marft_layer_matmul", "MarftLayerMatmul"
CHOICES = native_build.CHOICES
MAX_ROWS = 16        # rows (batch x new tokens) per call the kernel takes (kMaxRows in the source)

_library = native_build.Library(SOURCE, FLAGS, {TARGET: SYMBOL})


def status() -> native_build.Status:
    """Builds (or finds cached), loads and registers the kernel once per process."""
    return _library.status()


def resolve(requested: str, *, backend: str | None = None, dtype=None, devices: int | None = None,
            key: str = "model.decode_matmul") -> str:
    """``xla`` or ``native`` for ``requested`` (one of :data:`CHOICES`): ``auto`` is ``native`` on a
    single CPU device in float32 when the kernel builds, else ``xla``; ``native`` where it cannot
    run raises ``ValueError`` naming ``key`` and why (:func:`marft_jax.native_build.resolve_cpu_kernel`)."""
    return native_build.resolve_cpu_kernel(requested, _library, key=key, backend=backend, dtype=dtype,
                                           devices=devices)


def fits(x: jax.Array) -> bool:
    """Whether ``x`` ``[..., K]`` is a call the kernel takes (at most :data:`MAX_ROWS` rows, float32)."""
    return native_build.rows_fit(x, MAX_ROWS)


def matmul(x: jax.Array, stack: jax.Array, layer: jax.Array) -> jax.Array:
    """``x @ stack[layer]``, reading the layer's block in place.

    Args:
      x: ``[..., K]`` float32, at most :data:`MAX_ROWS` rows in all (:func:`fits`).
      stack: ``[L, K, N]`` float32, the stacked weights of every layer.
      layer: int32 scalar.
    Returns:
      ``[..., N]`` float32.
    """
    if stack.ndim != 3 or stack.dtype != jnp.float32 or x.shape[-1] != stack.shape[1]:
        raise ValueError(f"layer_matmul.matmul: x [..., K] and a float32 stack [L, K, N], got "
                         f"{x.shape} {x.dtype} and {stack.shape} {stack.dtype}")
    if not fits(x):
        raise ValueError(f"layer_matmul.matmul: at most {MAX_ROWS} float32 rows, got {x.shape} {x.dtype}")
    return _library.call_on_rows(TARGET, x, stack.shape[2], stack, jnp.asarray(layer, jnp.int32))
