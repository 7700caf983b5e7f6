"""What machine a measurement ran on, for benchmark JSON and experiment tables."""

from __future__ import annotations

import os
import platform


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
