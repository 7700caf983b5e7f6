"""A decode step's projections read from a GGUF checkpoint's quantized blocks: a native CPU
kernel (XLA FFI).

A decode step of a few rows is bound by reading the weights. A GGUF checkpoint stores them as
llama.cpp blocks of 32 weights (the embedded SmolLM2-135M: Q4_1 layers and a Q8_0 embedding,
96.6 MB); dequantized to float32 they are 538 MB, 5.6x the bytes. :func:`matmul` hands the
layer's blocks (``[L, N, K/32 * block bytes]`` uint8, each weight row's blocks in a row, as the
file holds them) to ``quant_matmul_kernel.cc``, which dequantizes each block in registers once
for all rows (``Q4_0``: ``d (q - 8)``, ``Q4_1``: ``d q + m``, ``Q8_0``: ``d q``, in float32 as
``gguf.quants.dequantize``) and accumulates the dot products in float32. The result equals
``x @ dequantize(w[layer]).T`` up to the summation order (and one rounding where ``d q + m`` is
fused).

Selected by ``model.decode_weights`` (``auto``: ``native`` on a single CPU device in float32
when the checkpoint has quantized blocks and the kernel builds; see :func:`resolve`) for cached
forwards of at most :data:`MAX_ROWS` rows, and the LM head of those rows. Forward only, one
device (the call is not partitioned). Built lazily (:mod:`marft_jax.native_build`); nothing
raises at import.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax import native_build

SOURCE = Path(__file__).with_name("quant_matmul_kernel.cc")
FLAGS = native_build.BASE_FLAGS
TARGET, SYMBOL = "marft_quant_matmul", "MarftQuantMatmul"
CHOICES = ("auto", "dequantized", "native")
MAX_ROWS = 64        # rows (batch x new tokens) per call the kernel takes (kMaxRows in the source)
BLOCK = 32           # weights per block
# ggml type id -> bytes per block of 32 weights (the kernel's formats)
FORMATS = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
_BY_BYTES = {nbytes: type_id for type_id, nbytes in FORMATS.values()}

_library = native_build.Library(SOURCE, FLAGS, {TARGET: SYMBOL})


def status() -> native_build.Status:
    """Builds (or finds cached), loads and registers the kernel once per process."""
    return _library.status()


def resolve(requested: str, *, quantized: bool, backend: str | None = None, dtype=None,
            devices: int | None = None, key: str = "model.decode_weights") -> str:
    """``dequantized`` or ``native`` for ``requested`` (one of :data:`CHOICES`).

    ``auto`` is ``native`` when the checkpoint has quantized blocks (``quantized``) and the
    kernel can run (a single CPU device, float32 parameters, the kernel builds), else
    ``dequantized``. ``native`` where it cannot run raises ``ValueError`` naming ``key`` and why.
    """
    if requested not in CHOICES:
        raise ValueError(f"{key}={requested!r} is not one of {list(CHOICES)}")
    if requested == "dequantized":
        return "dequantized"
    if not quantized:
        if requested == "native":
            raise ValueError(f"{key}=native needs a GGUF checkpoint with Q4_0, Q4_1 or Q8_0 tensors "
                             f"(model.name names float weights); use auto or dequantized")
        return "dequantized"
    impl = native_build.resolve_cpu_kernel("auto" if requested == "auto" else "native", _library, key=key,
                                           backend=backend, dtype=dtype, devices=devices)
    return "native" if impl == "native" else "dequantized"


def block_format(k: int, row_bytes: int) -> int:
    """The ggml type id of weight rows of ``k`` weights stored in ``row_bytes`` bytes."""
    if k % BLOCK or row_bytes % (k // BLOCK) or row_bytes // (k // BLOCK) not in _BY_BYTES:
        raise ValueError(f"quant_matmul: rows of {k} weights in {row_bytes} bytes are not "
                         f"Q4_0, Q4_1 or Q8_0 blocks")
    return _BY_BYTES[row_bytes // (k // BLOCK)]


def fits(x: jax.Array) -> bool:
    """Whether ``x`` ``[..., K]`` is a call the kernel takes (at most :data:`MAX_ROWS` rows, float32)."""
    return native_build.rows_fit(x, MAX_ROWS)


def matmul(x: jax.Array, blocks: jax.Array, layer: jax.Array | int = 0) -> jax.Array:
    """``x @ dequantize(blocks[layer]).T``, reading the layer's blocks in place.

    Args:
      x: ``[..., K]`` float32, at most :data:`MAX_ROWS` rows in all (:func:`fits`).
      blocks: ``[L, N, K/32 * block bytes]`` uint8: the N weight rows of every layer, each
        row K/32 GGUF blocks (Q4_0, Q4_1 or Q8_0, told apart by the bytes per block).
      layer: int32 scalar.
    Returns:
      ``[..., N]`` float32.
    """
    if blocks.ndim != 3 or blocks.dtype != jnp.uint8 or x.ndim < 1:
        raise ValueError(f"quant_matmul.matmul: x [..., K] and uint8 blocks [L, N, bytes], got "
                         f"{x.shape} {x.dtype} and {blocks.shape} {blocks.dtype}")
    fmt = block_format(x.shape[-1], blocks.shape[2])
    if not fits(x):
        raise ValueError(f"quant_matmul.matmul: at most {MAX_ROWS} float32 rows, got {x.shape} {x.dtype}")
    return _library.call_on_rows(TARGET, x, blocks.shape[1], blocks, jnp.asarray(layer, jnp.int32),
                                 format=np.int32(fmt))
