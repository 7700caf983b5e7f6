"""What machine a measurement ran on, for benchmark JSON and experiment tables."""

from __future__ import annotations

import os
import platform
import time


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo``, else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_info() -> dict:
    """``{"model", "logical_cores", "loadavg_1m_at_start"}`` (load where the OS reports it)."""
    info = {"model": cpu_model(), "logical_cores": os.cpu_count()}
    try:
        info["loadavg_1m_at_start"] = os.getloadavg()[0]
    except OSError:
        pass
    return info


def torch_matmul_flops(n: int = 3072, repeats: int = 5) -> float:
    """Best float32 FLOP/s of an ``n x n @ n x n`` torch matmul (a PyTorch side's roofline)."""
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    with torch.inference_mode():
        torch.matmul(a, b)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best
