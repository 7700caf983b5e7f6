"""Process-wide count of XLA compilations, for the ``perf/compiles`` metric.

Every program XLA builds passes through one ``jax.monitoring`` duration event, recorded by
``jax._src.interpreters.pxla._cached_compilation`` around ``compile_or_get_cached`` (jax
0.10.2)::

    /jax/core/compile/backend_compile_duration     (kwarg fun_name, e.g. "jit(ppo_update)")

A call that hits jit's in-memory executable cache records nothing, so it counts 0; a call with
a new shape (or new static arguments) records one event per program built, and an AOT
``f.lower(...).compile()`` counts 1 and is then reused by ``f(...)`` (same cache). A program read
from the *persistent* compilation cache (``jax_compilation_cache_dir``) also passes through the
event; it additionally records ``/jax/compilation_cache/cache_hits``, which we count apart, so
:meth:`CompileCounter.total` is the number of programs XLA really compiled.

The listener is registered once per process (idempotent, thread-safe); counts only grow, and
an iteration's compilations are a difference of two snapshots::

    with CompileCounter.counting() as c:
        state, metrics, _ = learner.iteration(...)
    metrics["perf/compiles"] = c.compiles
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from typing import Iterator

from jax import monitoring

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
PERSISTENT_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass(frozen=True)
class CompileSnapshot:
    """Counter values at one instant (all monotone since the listener was installed)."""

    events: int            # backend-compile events: programs compiled or read from the disk cache
    cache_hits: int        # of those, read from the persistent compilation cache
    seconds: float         # wall seconds inside backend compilation (cache reads included)

    @property
    def compiles(self) -> int:
        """Programs XLA compiled (persistent-cache reads excluded)."""
        return self.events - self.cache_hits


@dataclasses.dataclass
class CompileDelta:
    """Compilations between two instants; filled in when a :meth:`CompileCounter.counting`
    block exits (read live with :meth:`CompileCounter.delta` inside it)."""

    compiles: int = 0
    cache_hits: int = 0
    seconds: float = 0.0
    names: dict[str, int] = dataclasses.field(default_factory=dict)  # fun_name -> programs


class CompileCounter:
    """Process-wide counter of XLA compilations (class-level state, one listener per process)."""

    _lock = threading.Lock()
    _installed = False
    _events = 0
    _cache_hits = 0
    _seconds = 0.0
    _names: collections.Counter = collections.Counter()

    @classmethod
    def install(cls) -> None:
        """Register the ``jax.monitoring`` listeners (idempotent; every other method calls it).

        Compilations before the first call are not counted.
        """
        with cls._lock:
            if cls._installed and cls._still_registered():
                return
            monitoring.register_event_duration_secs_listener(cls._on_duration)
            monitoring.register_event_listener(cls._on_event)
            cls._installed = True

    @classmethod
    def _still_registered(cls) -> bool:
        """False after ``jax.monitoring.clear_event_listeners()`` (then :meth:`install` re-registers)."""
        try:
            from jax._src import monitoring as _impl  # the public module has no getters
        except ImportError:  # pragma: no cover - layout of a future jax
            return True
        return (cls._on_duration in _impl.get_event_duration_listeners()
                and cls._on_event in _impl.get_event_listeners())

    @classmethod
    def _on_duration(cls, event: str, duration_secs: float, **kwargs) -> None:
        if event != BACKEND_COMPILE_EVENT:
            return
        with cls._lock:
            cls._events += 1
            cls._seconds += float(duration_secs)
            cls._names[str(kwargs.get("fun_name", "?"))] += 1

    @classmethod
    def _on_event(cls, event: str, **kwargs) -> None:
        if event == PERSISTENT_CACHE_HIT_EVENT:
            with cls._lock:
                cls._cache_hits += 1

    @classmethod
    def snapshot(cls) -> CompileSnapshot:
        cls.install()
        with cls._lock:
            return CompileSnapshot(cls._events, cls._cache_hits, cls._seconds)

    @classmethod
    def total(cls) -> int:
        """Programs XLA compiled in this process since :meth:`install`."""
        return cls.snapshot().compiles

    @classmethod
    def names(cls) -> dict[str, int]:
        """Programs built per ``fun_name`` (compiled or read from the persistent cache)."""
        cls.install()
        with cls._lock:
            return dict(cls._names)

    @classmethod
    def delta(cls, since: CompileSnapshot, names_since: dict[str, int] | None = None) -> CompileDelta:
        """Compilations since the snapshot ``since`` (per-name counts since ``names_since``)."""
        now = cls.snapshot()
        names = {}
        if names_since is not None:
            names = {k: v - names_since.get(k, 0) for k, v in cls.names().items()
                     if v > names_since.get(k, 0)}
        return CompileDelta(compiles=now.compiles - since.compiles, cache_hits=now.cache_hits - since.cache_hits,
                            seconds=now.seconds - since.seconds, names=names)

    @classmethod
    @contextlib.contextmanager
    def counting(cls) -> Iterator[CompileDelta]:
        """Count the compilations of a block; the yielded :class:`CompileDelta` is filled on exit
        (also when the block raises)."""
        start, start_names = cls.snapshot(), cls.names()
        out = CompileDelta()
        try:
            yield out
        finally:
            d = cls.delta(start, start_names)
            out.compiles, out.cache_hits, out.seconds, out.names = d.compiles, d.cache_hits, d.seconds, d.names


def compile_metrics(delta: CompileDelta) -> dict[str, float]:
    """``perf/compiles`` (programs compiled) and ``timing_s/compile`` (seconds compiling) of a delta."""
    return {"perf/compiles": delta.compiles, "timing_s/compile": delta.seconds}
