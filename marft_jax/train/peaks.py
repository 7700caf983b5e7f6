"""Device peaks for utilisation metrics: FLOP/s and memory bandwidth per device kind, with
measured fallbacks, and the device's peak memory in use.

The table holds vendor datasheet figures per chip (dense, no sparsity; bf16 tensor FLOP/s,
float32 where the chip has a distinct non-tensor rate, HBM bandwidth). A device whose kind is
not in the table (the CPU, or a new chip) gets a *measured* roofline instead: a bf16 matmul for
the bf16 peak, a float32 one for the float32 peak, and a large array read, timed once per
process at first use. Every figure says where it came from (``source``), so a metric computed
against a measured roofline is not mistaken for a datasheet MFU.
"""

from __future__ import annotations

import dataclasses
import functools
import resource
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    """Per-device peaks: ``flops_bf16`` / ``flops_f32`` FLOP/s, ``hbm_bytes_per_s``; ``source``
    is ``"table:<name>"`` or ``"measured"``."""

    flops_bf16: float
    flops_f32: float
    hbm_bytes_per_s: float
    source: str

    def flops(self, dtype) -> float:
        half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        return self.flops_bf16 if half else self.flops_f32


# name -> (bf16 dense tensor FLOP/s, float32 FLOP/s, HBM bytes/s), vendor datasheets (dense, no
# sparsity). A device_kind matches the longest name it contains, compared lower-case with "-" and
# "_" read as spaces, so the PCIe / NVL / 40 GB variants win over the bare chip name. jax's kinds:
# "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200",
# "NVIDIA H200 NVL", "NVIDIA GH200 480GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB",
# "NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-40GB", "TPU v5 lite", ...
PEAKS = {
    "H100": (989e12, 67e12, 3.35e12),           # SXM5, HBM3
    "H100 PCIe": (756e12, 51e12, 2.0e12),       # HBM2e
    "H100 NVL": (835e12, 60e12, 3.9e12),        # per GPU of the pair, 94 GB HBM3
    "H200": (989e12, 67e12, 4.8e12),            # SXM, 141 GB HBM3e
    "H200 NVL": (835e12, 60e12, 4.8e12),
    "GH200": (989e12, 67e12, 4.0e12),           # Grace Hopper, 96 GB HBM3 (the 144 GB HBM3e: 4.9e12)
    "A100": (312e12, 19.5e12, 2.039e12),        # SXM4 80 GB
    "A100 80GB PCIe": (312e12, 19.5e12, 1.935e12),
    "A100 SXM4 40GB": (312e12, 19.5e12, 1.555e12),
    "A100 PCIE 40GB": (312e12, 19.5e12, 1.555e12),
    "L40S": (362e12, 91.6e12, 0.864e12),
    "L4": (121e12, 30.3e12, 0.3e12),
    "A10G": (70e12, 31.2e12, 0.6e12),
    "TPU v4": (275e12, 275e12 / 3, 1.2e12),    # f32 matmuls run as bf16 passes (~3 per product)
    "TPU v5 lite": (197e12, 197e12 / 3, 0.819e12),
    "TPU v5e": (197e12, 197e12 / 3, 0.819e12),
    "TPU v5p": (459e12, 459e12 / 3, 2.765e12),
    "TPU v5": (459e12, 459e12 / 3, 2.765e12),
    "TPU v6 lite": (918e12, 918e12 / 3, 1.64e12),
    "TPU v6e": (918e12, 918e12 / 3, 1.64e12),
}


def _norm(kind: str) -> str:
    return " ".join(kind.lower().replace("-", " ").replace("_", " ").split())


def table_peak(kind: str) -> DevicePeak | None:
    """The table's entry for a ``device_kind`` string (the longest name it contains), or None."""
    k = _norm(kind)
    for name in sorted(PEAKS, key=len, reverse=True):
        if _norm(name) in k:
            bf16, f32, bw = PEAKS[name]
            return DevicePeak(bf16, f32, bw, f"table:{name}")
    return None


def best_time(fn, *args, repeats: int = 3) -> float:
    """Best wall seconds of ``fn(*args)`` over ``repeats`` calls after one warm-up call."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def measured_matmul_flops(n: int = 1024, dtype=jnp.float32, device: Any | None = None) -> float:
    """FLOP/s of an ``n x n @ n x n`` matmul in ``dtype`` on ``device`` (best of 3)."""
    dev = device or jax.devices()[0]
    a = jax.device_put(jnp.ones((n, n), dtype), dev)
    return 2.0 * n ** 3 / best_time(jax.jit(jnp.matmul), a, a)


def measured_read_bandwidth(nbytes: int = 256 << 20, device: Any | None = None) -> float:
    """Bytes/s of a reduction over an ``nbytes`` float32 array on ``device`` (best of 3)."""
    dev = device or jax.devices()[0]
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), dev)
    return nbytes / best_time(jax.jit(jnp.sum), x)


@functools.lru_cache(maxsize=None)
def _measured(platform: str, kind: str, device: Any = None) -> DevicePeak:
    # Each dtype's own matmul: bf16 runs on the tensor cores of an accelerator (many times the
    # float32 rate) and is converted to float32 on XLA:CPU (slower than float32 there). An
    # accelerator needs large operands to come near its peak; the CPU small ones to stay quick.
    cpu = platform == "cpu"
    n, nbytes = (1024, 256 << 20) if cpu else (8192, 1 << 30)
    return DevicePeak(flops_bf16=measured_matmul_flops(n, jnp.bfloat16, device),
                      flops_f32=measured_matmul_flops(n, jnp.float32, device),
                      hbm_bytes_per_s=measured_read_bandwidth(nbytes, device), source="measured")


def device_peak(device: Any | None = None) -> DevicePeak:
    """Peaks of ``device`` (default: the first): the table's, else measured once per process."""
    dev = device or jax.devices()[0]
    kind = str(getattr(dev, "device_kind", ""))
    return table_peak(kind) or _measured(dev.platform, kind, None if device is None else dev)


def peak_device_memory_bytes(device: Any | None = None) -> int | None:
    """The device's peak bytes in use (``memory_stats()['peak_bytes_in_use']``), None where the
    backend does not report it (CPU)."""
    dev = device or jax.devices()[0]
    try:
        stats = dev.memory_stats()
    except Exception:   # backends without memory stats raise or return None
        return None
    if not stats:
        return None
    peak = stats.get("peak_bytes_in_use", stats.get("bytes_in_use"))
    return int(peak) if peak is not None else None


def peak_host_rss_bytes() -> int:
    """This process's peak resident set size (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
