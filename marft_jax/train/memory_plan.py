"""Memory plans of compiled programs, checked against the machine before the work starts.

XLA knows after compiling how much memory a program needs (its buffer assignment). Comparing
that plan with what the device or host can give turns a ``RESOURCE_EXHAUSTED`` traceback
minutes into a run into an error at warm-up that names the program and the config keys that
shrink it::

    compiled, plan = plan_of(ppo_update, base, state, batch, mask, flag, cfg=cfg, ucfg=ucfg)
    check_fits({"ppo_update": plan}, available_bytes(), keys_to_lower=UPDATE_KEYS)

Which figures (``compiled.memory_analysis()``, a ``CompiledMemoryStats``, bytes per device):

* ``argument_size_in_bytes``: the inputs (frozen base, train state, batch). They are resident
  while the program runs, so they belong to its footprint.
* ``output_size_in_bytes``: the results, allocated by the program.
* ``alias_size_in_bytes``: outputs written into donated inputs (``ppo_update`` donates the
  train state). Those bytes are in both the argument and the output figure, so they are
  subtracted once.
* ``temp_size_in_bytes``: XLA's scratch buffers (activations kept for the backward pass,
  attention scores, gradients); the part that grows with sequence length.
* ``generated_code_size_in_bytes``: the executable, resident on GPU/TPU (0 on CPU).

``planned = argument + output - alias + temp + generated_code``. The ``host_*`` twins (memory
a program places in host RAM on an accelerator) are reported by :func:`memory_breakdown` but
not added: they do not occupy the device. ``peak_memory_in_bytes`` is not used: on XLA:CPU it
is below ``argument + temp`` for simple programs, so it is not the whole footprint there. A
backend without a memory analysis (``memory_analysis()`` returns ``None`` or raises) yields a
plan of ``None``, which :func:`check_fits` skips.

What it catches (``ppo_update``, SmolLM2-135M, three agents, token level, 8 rows, context 1024
+ actions 512, float32 on CPU): 55.1 GiB planned; 28.0 GiB with ``ppo.micro_batches=2``;
3.9 GiB with ``model.remat=true``; 2.3 GiB with both. Each plan compiles in about 8 s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax

GIB = 1024 ** 3

# Config keys that shrink the PPO update program, most effective first (what the error names).
UPDATE_KEYS = ("ppo.micro_batches (raise it)", "model.remat (set it to full)", "rollout.rows",
               "rollout.max_new_tokens", "rollout.context_window")

# cgroup v1 reports "no limit" as a huge page-aligned number (2**63 - 4096 on x86-64).
_CGROUP_V1_UNLIMITED = 1 << 62


class MemoryPlanError(ValueError):
    """A compiled program plans more memory than the machine can give (names what to change)."""

    def __init__(self, message: str, *, program: str, planned_bytes: int, available_bytes: int,
                 keys: Sequence[str]):
        super().__init__(message)
        self.program = program
        self.planned_bytes = planned_bytes
        self.available_bytes = available_bytes
        self.keys = tuple(keys)


def _memory_stats(compiled) -> Any | None:
    try:
        stats = compiled.memory_analysis()
    except Exception:  # backends without an analysis raise Unimplemented / NotImplementedError
        return None
    if isinstance(stats, (list, tuple)):  # older jax: one entry per device program
        stats = stats[0] if stats else None
    return stats


def memory_breakdown(compiled) -> dict[str, int] | None:
    """The analysis' byte counts by name (``None`` when the backend reports none)."""
    stats = _memory_stats(compiled)
    if stats is None:
        return None
    names = ("argument", "output", "alias", "temp", "generated_code", "host_argument", "host_output",
             "host_alias", "host_temp", "host_generated_code")
    return {n: int(getattr(stats, f"{n}_size_in_bytes", 0) or 0) for n in names}


def planned_bytes(compiled) -> int | None:
    """Bytes one device holds while ``compiled`` runs: argument + output − alias + temp + code.

    ``compiled`` is a ``jax.stages.Compiled`` (``jitted.lower(...).compile()``). Returns ``None``
    when the backend has no memory analysis.
    """
    b = memory_breakdown(compiled)
    if b is None:
        return None
    return b["argument"] + b["output"] - b["alias"] + b["temp"] + b["generated_code"]


def plan_of(jitted_fn, *args, **kwargs) -> tuple[Any, int | None]:
    """Lower and compile ``jitted_fn`` for these arguments without running it.

    Arguments may be the real arrays (nothing runs and nothing is donated: lowering reads only
    shapes, dtypes and shardings) or ``jax.ShapeDtypeStruct`` (see :func:`abstract`); static
    ones as usual, by keyword for ``static_argnames``. The compiled program lands in jit's
    cache, so a later call of ``jitted_fn`` with arrays of the same shapes and placement does
    not compile again. Returns ``(compiled, planned_bytes(compiled))``.
    """
    compiled = jitted_fn.lower(*args, **kwargs).compile()
    return compiled, planned_bytes(compiled)


def abstract(tree):
    """Arrays -> ``jax.ShapeDtypeStruct``, keyed like the arrays in jit's cache.

    A committed array (explicitly placed or sharded) keeps its sharding; an uncommitted one
    (``jnp.asarray``, outputs of uncommitted computations) gets none, because a struct that
    names a sharding compiles a separate program from a call with uncommitted arrays.
    """
    def one(x):
        if isinstance(x, jax.Array):
            if getattr(x, "committed", False):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        return x
    return jax.tree.map(one, tree)


# ---------------------------------------------------------------------------------------------
# What the machine can give


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _read_keyed(path: Path, key: str, scale: int = 1) -> int | None:
    """``key value [unit]`` lines (``/proc/meminfo``, ``memory.stat``) -> value · scale."""
    try:
        for line in path.read_text().splitlines():
            parts = line.replace(":", " ").split()
            if len(parts) >= 2 and parts[0] == key:
                return int(parts[1]) * scale
    except (OSError, ValueError):
        return None
    return None


def _own_cgroup_dirs(cgroup_root: Path, proc_self_cgroup: Path) -> list[tuple[Path, int]]:
    """Candidate (directory, version) pairs for this process' memory cgroup, innermost first."""
    out: list[tuple[Path, int]] = []
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        rel = path.lstrip("/")
        if hier == "0" and controllers == "":
            out.append((cgroup_root / rel, 2))
        elif "memory" in controllers.split(","):
            out.append((cgroup_root / "memory" / rel, 1))
    # Inside a container the process' own cgroup is usually mounted as the root.
    out += [(cgroup_root, 2), (cgroup_root / "memory", 1)]
    return out


def cgroup_headroom_bytes(cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
                          proc_self_cgroup: str | os.PathLike = "/proc/self/cgroup") -> int | None:
    """Bytes this process' memory cgroup can still allocate, or ``None`` without a limit.

    cgroup v2: ``memory.max − (memory.current − inactive_file)``; v1: ``memory.limit_in_bytes −
    (memory.usage_in_bytes − total_inactive_file)``. Inactive page cache is reclaimed before
    the OOM killer acts, so it counts as free (the kubelet's "working set" rule).
    """
    root = Path(cgroup_root)
    for d, version in _own_cgroup_dirs(root, Path(proc_self_cgroup)):
        if version == 2:
            limit, used = _read_int(d / "memory.max"), _read_int(d / "memory.current")
            inactive = _read_keyed(d / "memory.stat", "inactive_file") or 0
        else:
            limit, used = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
            inactive = _read_keyed(d / "memory.stat", "total_inactive_file") or 0
            if limit is not None and limit >= _CGROUP_V1_UNLIMITED:
                limit = None
        if limit is None:
            continue
        return max(limit - max((used or 0) - inactive, 0), 0)
    return None


def host_available_bytes(meminfo: str | os.PathLike = "/proc/meminfo",
                         cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
                         proc_self_cgroup: str | os.PathLike = "/proc/self/cgroup") -> int:
    """Host RAM a new allocation can get now: ``MemAvailable`` (``os.sysconf`` free pages where
    there is no ``/proc/meminfo``), capped by the cgroup's headroom."""
    avail = _read_keyed(Path(meminfo), "MemAvailable", 1024)
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 0
    head = cgroup_headroom_bytes(cgroup_root, proc_self_cgroup)
    return avail if head is None else min(avail, head)


def _live_array_bytes(platform: str) -> int:
    total = 0
    for a in jax.live_arrays():
        try:
            total += sum(s.data.nbytes for s in a.addressable_shards if s.device.platform == platform)
        except Exception:  # deleted or donated while we looked
            continue
    return total


def available_bytes(device: jax.Device | None = None) -> int:
    """Memory one compiled program may plan on ``device`` (default: the first local device).

    GPU/TPU: the allocator's pool, ``device.memory_stats()['bytes_limit']`` (all of it: plans
    include their arguments, which already live in that pool). CPU: the host's free memory
    (:func:`host_available_bytes`) plus the bytes of this process' live jax arrays, since a
    plan counts its resident arguments (weights, state, batch) that the free figure already
    excludes. Every CPU device shares that host memory.
    """
    device = device or jax.local_devices()[0]
    if device.platform != "cpu":
        stats = None
        try:
            stats = device.memory_stats()
        except Exception:
            stats = None
        if stats and stats.get("bytes_limit"):
            return int(stats["bytes_limit"])
    return host_available_bytes() + _live_array_bytes("cpu")


def check_fits(plans: Mapping[str, int | None], available: int, *, keys_to_lower: Sequence[str],
               fraction: float = 0.9) -> None:
    """Raise :class:`MemoryPlanError` if any program plans more than ``fraction · available``.

    Args:
      plans: program name -> planned bytes (:func:`planned_bytes`); ``None`` entries (no
        analysis on this backend) are skipped.
      available: bytes the machine can give (:func:`available_bytes`).
      keys_to_lower: config keys that shrink these programs, named in the error in this order
        (e.g. :data:`UPDATE_KEYS`).
      fraction: share of ``available`` a plan may use (the rest covers fragmentation, the
        runtime and buffers outside the plan).
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    budget = fraction * available
    over = {name: p for name, p in plans.items() if p is not None and p > budget}
    if not over:
        return
    name, plan = max(over.items(), key=lambda kv: kv[1])
    lines = [f"program {n!r} plans {p / GIB:.2f} GiB" for n, p in sorted(over.items(), key=lambda kv: -kv[1])]
    msg = (f"{'; '.join(lines)}, more than {fraction:.0%} of the {available / GIB:.2f} GiB available "
           f"({budget / GIB:.2f} GiB). It would fail with RESOURCE_EXHAUSTED. To shrink it, change "
           f"one of: {', '.join(keys_to_lower)}.")
    raise MemoryPlanError(msg, program=name, planned_bytes=plan, available_bytes=available, keys=keys_to_lower)
