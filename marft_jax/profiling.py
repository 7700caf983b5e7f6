"""``jax.profiler`` traces of training iterations and benchmarks (TensorBoard / Perfetto).

A trace holds the host annotations of every stage (``rollout`` with ``rollout/step<s>/agents<i>``
per sampler call and ``sampler/prefill`` / ``sampler/decode`` inside it, ``prepare``,
``update``) and, inside the compiled programs, the named scopes of the stages
(``rollout/prefill``, ``rollout/decode``, ``prepare/critic_features``, ``prepare/old_logprobs``,
``prepare/backups``, ``update/critic_step``, ``update/agent_policy_step``,
``update/happo_factor``). ``docs/profiling.md`` shows how to read one.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import jax

ENV_DIR = "MARFT_JAX_PROFILE_DIR"   # set by `marft-jax bench ... --profile DIR` for subprocess sides


@contextlib.contextmanager
def trace(directory: str | os.PathLike | None):
    """Trace everything inside the block into ``directory`` (nothing when it is None/empty);
    a Perfetto ``trace.json.gz`` is written next to the TensorBoard ``.xplane.pb``."""
    if not directory:
        yield
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.profiler.start_trace(str(directory), create_perfetto_trace=True)
    try:
        yield
    finally:
        jax.profiler.stop_trace()


class StepProfiler:
    """``train.profile``: trace iterations ``start .. start + steps - 1`` (0-based) into ``directory``.

    Call :meth:`before` and :meth:`after` around each iteration and :meth:`close` at the end
    (also stops a trace cut short by an exception or a stop signal).
    """

    def __init__(self, start: int | None, steps: int, directory: str | os.PathLike):
        self.start, self.steps, self.directory = start, max(1, int(steps)), Path(directory)
        self.active = False

    def before(self, iteration: int) -> None:
        if self.start is not None and iteration == self.start and not self.active:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True

    def after(self, iteration: int) -> None:
        if self.active and iteration >= self.start + self.steps - 1:
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            print(f"profile trace written to {self.directory} (tensorboard --logdir, or the Perfetto "
                  f"trace.json.gz in ui.perfetto.dev)", flush=True)
