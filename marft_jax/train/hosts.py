"""Which problem rows this process plays, and the host-side exchanges between the processes
that play one batch together.

Under ``jax.distributed`` every batch of ``B`` problem rows is split into one contiguous block
per process: process ``p`` of ``P`` owns rows ``[p·B // P, (p+1)·B // P)`` (:meth:`ProcessRows.bounds`).
Because ``jax.devices()`` lists the devices process by process and the mesh is laid out in that
order, these are the rows that the row shards (``data`` x ``fsdp``) of the process's own devices
hold. The process draws only these problems from the data stream (``ProblemStream``), builds
their prompts, decodes their responses and scores them; the device programs (sampler, feature
pass, update) still see the global batch, in the order one process would give it:

* each sampler call's prompts: every process contributes its rows' prompts, and the call runs
  on the concatenation in process order (the single-process order of the rows, so the
  sampler's per-row randomness and its static shapes are the same), then each process keeps
  its rows of the result (``iteration.make_generate``);
* the end of the rollout's step loop and the context bucket are decided from every process's
  rows (:meth:`ProcessRows.any`, :meth:`ProcessRows.max`): every process makes the same sampler
  calls and compiles the same programs;
* the trajectory: the processes' row blocks are concatenated into the global batch
  (:func:`gather_trajectory`), from which the packing plan and the metrics are computed, the
  same on every process.

The exchanges are :func:`jax.experimental.multihost_utils.process_allgather` (JAX's own
collectives; nothing of ours goes over the network) of pickled host objects in byte buffers
padded to a power of two, so a run compiles a handful of tiny gather programs. On one process
every method is the identity and nothing is exchanged.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Sequence

import numpy as np

from marft_jax.rl.trajectory import Trajectory

_MIN_BUFFER = 1 << 10        # bytes: the smallest gather buffer (buffers are powers of two above it)


@dataclasses.dataclass(frozen=True)
class ProcessRows:
    """Process ``index`` of ``count``: its contiguous block of every batch's rows."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"process index {self.index} is not in [0, {self.count})")

    @classmethod
    def of_this_process(cls) -> "ProcessRows":
        """This process's share under ``jax.distributed`` (index 0 of 1 without it)."""
        import jax

        return cls(jax.process_index(), jax.process_count())

    @property
    def single(self) -> bool:
        return self.count == 1

    def bounds(self, total: int) -> tuple[int, int]:
        """``(lo, hi)``: this process's rows of a batch of ``total`` rows (contiguous, disjoint
        over the processes, covering the batch in process order; sizes differ by at most one)."""
        return self.index * total // self.count, (self.index + 1) * total // self.count

    def share(self, items: Sequence) -> list:
        """This process's block of ``items`` (all of them on one process)."""
        lo, hi = self.bounds(len(items))
        return list(items[lo:hi])

    def gather(self, obj: Any) -> list:
        """``[obj of process 0, obj of process 1, ...]`` (every process must call this together,
        with picklable objects). One process: ``[obj]``, nothing exchanged."""
        if self.single:
            return [obj]
        from jax.experimental import multihost_utils

        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int32))).reshape(-1)
        cap = max(_MIN_BUFFER, 1 << int(sizes.max() - 1).bit_length())
        buf = np.zeros(cap, np.uint8)
        buf[:data.size] = data
        bufs = np.asarray(multihost_utils.process_allgather(buf))               # [count, cap]
        return [pickle.loads(bufs[p, :int(sizes[p])].tobytes()) for p in range(self.count)]

    def _ints(self, value: int) -> np.ndarray:
        """``[count]`` int64: every process's ``value``."""
        if self.single:
            return np.asarray([value], np.int64)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(np.asarray([value], np.int32))).reshape(-1)

    def any(self, flag: bool) -> bool:
        """True when ``flag`` is true on some process (every process calls this together)."""
        return bool(self._ints(int(bool(flag))).max())

    def max(self, value: int) -> int:
        """The largest ``value`` over the processes (every process calls this together)."""
        return int(self._ints(int(value)).max())


def concat_rows(parts: Sequence[Trajectory]) -> Trajectory:
    """One trajectory of the rows of ``parts`` in order (``[S, B, ...]`` fields along axis 1,
    the bootstrap contexts ``[B, N, L]`` along axis 0); the parts must agree on ``S, N, L, K``."""
    if len(parts) == 1:
        return parts[0]

    def cat(name: str, *xs):
        if xs[0] is None:
            return None
        return np.concatenate([np.asarray(x) for x in xs], axis=0 if name.startswith("boot_") else 1)

    fields = {f.name: cat(f.name, *(getattr(p, f.name) for p in parts)) for f in dataclasses.fields(Trajectory)}
    return Trajectory(**fields)


def gather_trajectory(rows: ProcessRows, local: Trajectory) -> Trajectory:
    """The global batch from every process's rows (NumPy arrays on every process, rows in
    process order)."""
    local = Trajectory(**{f.name: None if getattr(local, f.name) is None else np.asarray(getattr(local, f.name))
                          for f in dataclasses.fields(Trajectory)})
    traj = concat_rows(rows.gather(local))
    traj.check()
    return traj
