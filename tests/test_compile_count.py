"""The process-wide XLA compilation counter behind ``perf/compiles``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.train.compile_count import BACKEND_COMPILE_EVENT, CompileCounter, compile_metrics

# The counts below are compiles: no program may come from the session's persistent cache.
pytestmark = pytest.mark.usefixtures("no_persistent_compile_cache")


def _fresh_fn():
    """A new jitted function per test, so no earlier test has compiled it."""
    @jax.jit
    def affine_then_sum(x):
        return jnp.sum(x * 2.0 + 1.0, axis=-1)
    return affine_then_sum


def test_same_shape_counts_once_new_shape_counts_again():
    f = _fresh_fn()
    x4, x8 = np.ones((3, 4), np.float32), np.ones((3, 8), np.float32)   # numpy: no eager compiles
    t0 = CompileCounter.total()
    jax.block_until_ready(f(x4))
    t1 = CompileCounter.total()
    jax.block_until_ready(f(x4 + 1))                                     # same shape: cached
    t2 = CompileCounter.total()
    jax.block_until_ready(f(x8))                                         # new shape
    t3 = CompileCounter.total()
    assert (t1 - t0, t2 - t1, t3 - t2) == (1, 0, 1)


def test_counting_block_reports_programs_and_names():
    f = _fresh_fn()
    x = np.ones((2, 5), np.float32)
    with CompileCounter.counting() as first:
        jax.block_until_ready(f(x))
    with CompileCounter.counting() as second:
        for _ in range(3):
            jax.block_until_ready(f(x))
    assert first.compiles == 1 and first.names == {"jit(affine_then_sum)": 1}
    assert first.seconds > 0
    assert second.compiles == 0 and second.names == {}
    m = compile_metrics(first)
    assert m["perf/compiles"] == 1 and m["timing_s/compile"] > 0


def test_aot_compile_is_counted_once_and_reused_by_calls():
    f = _fresh_fn()
    with CompileCounter.counting() as c:
        compiled = f.lower(jax.ShapeDtypeStruct((2, 7), jnp.float32)).compile()
        jax.block_until_ready(f(np.ones((2, 7), np.float32)))
        jax.block_until_ready(compiled(np.ones((2, 7), np.float32)))
    assert c.compiles == 1


def test_install_is_idempotent_and_survives_clear_event_listeners():
    for _ in range(5):
        CompileCounter.install()
    f = _fresh_fn()
    with CompileCounter.counting() as c:
        jax.block_until_ready(f(np.ones((1, 3), np.float32)))
    assert c.compiles == 1                                   # one listener, not five
    from jax._src import monitoring as impl
    saved = (impl.get_event_listeners(), impl.get_event_duration_listeners(),
             impl.get_event_time_span_listeners())
    jax.monitoring.clear_event_listeners()
    try:
        with CompileCounter.counting() as c:                 # re-registers
            jax.block_until_ready(f(np.ones((1, 9), np.float32)))
        assert c.compiles == 1
    finally:
        for cb in saved[0]:
            if cb not in impl.get_event_listeners():
                jax.monitoring.register_event_listener(cb)
        for cb in saved[1]:
            if cb not in impl.get_event_duration_listeners():
                jax.monitoring.register_event_duration_secs_listener(cb)
        for cb in saved[2]:
            if cb not in impl.get_event_time_span_listeners():
                jax.monitoring.register_event_time_span_listener(cb)


def test_event_name_exists_in_installed_jax():
    """The counter depends on this jax-internal event name: fail loudly if jax renames it."""
    from jax._src import dispatch
    assert dispatch.BACKEND_COMPILE_EVENT == BACKEND_COMPILE_EVENT


def test_persistent_cache_read_is_not_a_compile(tmp_path):
    """In a subprocess (global config): a disk-cache read counts as a cache hit, not a compile."""
    code = textwrap.dedent(f"""
        import jax, jax.numpy as jnp, numpy as np
        jax.config.update("jax_compilation_cache_dir", {str(tmp_path)!r})
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        from marft_jax.train.compile_count import CompileCounter
        f = jax.jit(lambda x: jnp.tanh(x) @ x.T)
        x = np.ones((4, 4), np.float32)
        with CompileCounter.counting() as a:
            jax.block_until_ready(f(x))
        jax.clear_caches()
        with CompileCounter.counting() as b:
            jax.block_until_ready(f(x))
        print(a.compiles, a.cache_hits, b.compiles, b.cache_hits)
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "0", "0", "1"], out.stdout
