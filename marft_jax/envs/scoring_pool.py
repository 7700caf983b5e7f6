"""Score batches of transcripts in worker processes while the accelerator keeps working.

``ScoringPool(task, workers=N)`` sends the task to each worker once (spawn start method, so
it is safe next to JAX/threads); ``submit(transcripts)`` returns a :class:`ScoreBatch` handle
at once; ``handle.result()`` gives ``list[Score]`` in input order, identical to the serial
reference :func:`marft_jax.envs.task.score_all`. ``workers=0`` scores serially in the caller
(``submit`` then returns an already finished handle).

Example::

    with ScoringPool(task, workers=4) as pool:
        pending = pool.submit(transcripts)     # returns immediately
        ...                                    # run the next rollout on the accelerator
        scores = pending.result()

Scripts that create a pool with ``workers > 0`` need the ``if __name__ == "__main__":`` guard:
a spawn-started worker re-imports the main module, and without the guard it fails during
start-up, which leaves ``concurrent.futures`` waiting forever (CPython's behaviour). The
``marft-jax`` commands are guarded; so is ``experiments/cpu_repro.py``.

The workers leave the caller's process group, so a signal sent to the whole group (Ctrl-C in a
terminal, ``kill -TERM -- -PGID``) reaches only the caller, which decides when to stop them
(the trainer finishes its iteration, scores it and checkpoints first). Signals sent to a
worker itself (the pool's own ``terminate`` when it breaks) still stop it. A worker whose
caller has died (``SIGKILL``) exits within a second instead of lingering.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import multiprocessing
import os
from typing import Sequence

from marft_jax.envs.parent_watch import exit_when_orphaned
from marft_jax.envs.task import Score, Task, Transcript, score_all

_WORKER_TASK: Task | None = None


def _init_worker(task: Task, parent_pid: int) -> None:
    global _WORKER_TASK
    _WORKER_TASK = task
    if hasattr(os, "setpgid"):       # POSIX: out of the caller's process group (module docstring)
        os.setpgid(0, 0)
        exit_when_orphaned(parent_pid)     # outside the caller's group it no longer dies with it


def _score_chunk(transcripts: Sequence[Transcript]) -> list[Score]:
    if _WORKER_TASK is None:
        raise RuntimeError("scoring worker was not initialised with a task")
    return score_all(_WORKER_TASK, transcripts)


class ScoreBatch:
    """Handle to a submitted batch: ``done()`` and ``result(timeout)`` -> ``list[Score]``."""

    def __init__(self, futures: Sequence[cf.Future]) -> None:
        self._futures = list(futures)

    def done(self) -> bool:
        """True when every chunk has finished (successfully or not)."""
        return all(f.done() for f in self._futures)

    def result(self, timeout: float | None = None) -> list[Score]:
        """Scores in input order; re-raises a worker's exception; ``TimeoutError`` after
        ``timeout`` seconds (the batch keeps running)."""
        cf.wait(self._futures, timeout=timeout)
        if not self.done():
            raise TimeoutError(f"scoring batch not finished within {timeout} s")
        return [score for f in self._futures for score in f.result()]


def _finished(scores: list[Score]) -> cf.Future:
    future: cf.Future = cf.Future()
    future.set_result(scores)
    return future


class ScoringPool:
    """A process pool bound to one task.

    Args:
      task: a picklable Task (pickled once per worker at start-up).
      workers: number of worker processes; 0 = serial in the calling process.
      chunk_size: transcripts per work item; default splits a batch into about
        ``4 * workers`` chunks.
      start_method: multiprocessing start method (``"spawn"`` is safe with JAX threads).
    """

    def __init__(
        self,
        task: Task,
        workers: int = 0,
        *,
        chunk_size: int | None = None,
        start_method: str = "spawn",
    ) -> None:
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.task, self.workers, self.chunk_size = task, workers, chunk_size
        self._executor: cf.ProcessPoolExecutor | None = None
        if workers > 0:
            self._executor = cf.ProcessPoolExecutor(
                max_workers=workers,
                mp_context=multiprocessing.get_context(start_method),
                initializer=_init_worker,
                initargs=(task, os.getpid()),
            )

    def _chunks(self, transcripts: Sequence[Transcript]) -> list[list[Transcript]]:
        size = self.chunk_size or max(1, math.ceil(len(transcripts) / (4 * self.workers)))
        return [list(transcripts[i : i + size]) for i in range(0, len(transcripts), size)]

    def submit(self, transcripts: Sequence[Transcript]) -> ScoreBatch:
        """Start scoring ``transcripts``; returns without waiting (unless ``workers == 0``)."""
        if self._executor is None:
            if self.workers > 0:
                raise RuntimeError("ScoringPool is closed")
            return ScoreBatch([_finished(score_all(self.task, transcripts))])
        return ScoreBatch([self._executor.submit(_score_chunk, c) for c in self._chunks(transcripts)])

    def score(self, transcripts: Sequence[Transcript]) -> list[Score]:
        """Score and wait: ``submit(transcripts).result()``."""
        return self.submit(transcripts).result()

    def close(self) -> None:
        """Wait for submitted work, then stop the workers (idempotent)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def __enter__(self) -> "ScoringPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
