"""Helper processes (scoring workers, math-verify workers) that exit once their parent is gone."""

from __future__ import annotations

import os
import threading
import time


def exit_when_orphaned(parent_pid: int | None = None, poll_s: float = 0.5) -> threading.Thread:
    """Start a daemon thread that ends this process (``os._exit(0)``) within ``poll_s`` seconds of
    its parent's death (seen as a change of ``os.getppid()``: the process was re-parented).
    ``parent_pid``: the parent's pid as the parent saw it (default: the current parent)."""
    parent = os.getppid() if parent_pid is None else parent_pid

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    thread = threading.Thread(target=watch, name="exit-when-orphaned", daemon=True)
    thread.start()
    return thread
