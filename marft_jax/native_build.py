"""Build and cache the native CPU kernels (C++ XLA FFI handlers) with the system compiler.

Shared by the backups kernel (:mod:`marft_jax.rl.native`), the decode-attention kernel
(:mod:`marft_jax.models.cache_attention`) and the decode projections
(:mod:`marft_jax.models.layer_matmul`, :mod:`marft_jax.models.quant_matmul`). A library is compiled once per source, flags,
jaxlib version, machine and compiler into a per-user cache (``$MARFT_JAX_CACHE``, else
``$XDG_CACHE_HOME/marft_jax``, else ``~/.cache/marft_jax``); the build writes a temporary file
and renames it (atomic), so concurrent processes are safe. Nothing raises at import.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

import jax

BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=fast", "-Wno-psabi")


class NativeUnavailable(RuntimeError):
    """A kernel could not be built or loaded; the message says why."""


def cache_dir() -> Path:
    """Where built libraries live: ``$MARFT_JAX_CACHE`` or ``$XDG_CACHE_HOME/marft_jax``."""
    env = os.environ.get("MARFT_JAX_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "marft_jax"


def find_compiler() -> str:
    """Path of the C++ compiler: ``$CXX`` if set (must exist), else ``c++``/``g++``/``clang++``."""
    cxx = os.environ.get("CXX")
    if cxx:
        found = shutil.which(cxx)
        if not found:
            raise NativeUnavailable(f"C++ compiler $CXX={cxx!r} not found")
        return found
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    raise NativeUnavailable("no C++ compiler found ($CXX unset; none of c++, g++, clang++ on PATH)")


def _compiler_version(cxx: str) -> str:
    try:
        proc = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"cannot run {cxx} --version: {e}") from None
    if proc.returncode != 0:
        raise NativeUnavailable(f"{cxx} --version failed: {proc.stderr.strip()[-500:]}")
    return proc.stdout.strip()


def library_path(source: Path, flags: Sequence[str], cxx: str, directory: Path | None = None) -> Path:
    """The cache file for this source, flags, jaxlib version, machine and compiler."""
    import jaxlib

    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(flags).encode(), jaxlib.__version__.encode(),
                 platform.machine().encode(), cxx.encode(), _compiler_version(cxx).encode()):
        key.update(part)
        key.update(b"\0")
    return (directory or cache_dir()) / f"{source.stem}-{key.hexdigest()[:20]}.so"


def build(source: Path, flags: Sequence[str] = BASE_FLAGS,
          directory: Path | None = None) -> tuple[Path, bool, float | None]:
    """Builds the library of ``source`` unless cached.

    Returns:
      ``(path, compiled, compile_s)``: ``compiled`` is False on a cache hit (then
      ``compile_s`` is None).

    Raises:
      NativeUnavailable: no compiler, an unwritable cache directory or a failed compile (the
        message ends with the compiler's stderr tail).
    """
    cxx = find_compiler()
    path = library_path(source, flags, cxx, directory)
    if path.exists():
        return path, False, None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=path.parent)
        os.close(fd)
    except OSError as e:
        raise NativeUnavailable(f"cache directory {path.parent} not writable: {e}") from None
    cmd = [cxx, *flags, "-I", jax.ffi.include_dir(), str(source), "-o", tmp]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise NativeUnavailable(f"{' '.join(cmd)} failed (exit {proc.returncode}): "
                                    f"{proc.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"{' '.join(cmd)} failed: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path, True, time.perf_counter() - t0


@dataclasses.dataclass(frozen=True)
class Status:
    """Outcome of building/loading a kernel library in this process.

    ``compiled``: this process ran the compiler (cache miss); ``compile_s``: its wall seconds
    (``None`` on a cache hit); ``load_s``: wall seconds of the whole load (compile, if any,
    plus load and registration); ``reason``: why it is unavailable.
    """

    available: bool
    reason: str = ""
    library: str | None = None
    compiled: bool = False
    compile_s: float | None = None
    load_s: float | None = None


class Library:
    """A kernel library built (or found cached), loaded and its FFI targets registered for
    the CPU once per process, at the first :meth:`status` call (thread-safe).

    ``targets``: FFI target name -> exported handler symbol.
    """

    def __init__(self, source: Path, flags: Sequence[str], targets: Mapping[str, str]):
        self.source, self.flags, self.targets = source, tuple(flags), dict(targets)
        self._lock = threading.Lock()
        self._status: Status | None = None

    def _load(self) -> Status:
        t0 = time.perf_counter()
        try:
            path, compiled, compile_s = build(self.source, self.flags)
            lib = ctypes.CDLL(str(path))
            for target, symbol in self.targets.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        except (NativeUnavailable, OSError, AttributeError) as e:
            return Status(available=False, reason=str(e))
        return Status(available=True, library=str(path), compiled=compiled, compile_s=compile_s,
                      load_s=time.perf_counter() - t0)

    def status(self) -> Status:
        with self._lock:
            if self._status is None:
                self._status = self._load()
            return self._status

    def call_on_rows(self, target: str, x, cols: int, *operands, **attrs):
        """``target``'s FFI call on ``x`` ``[..., K]`` flattened to ``[rows, K]`` (then ``operands``
        and the ``attrs``), returning float32 ``[..., cols]``. Builds and registers the library
        first (a config may name a native kernel directly); raises ``RuntimeError`` naming why it
        is unavailable."""
        import jax.numpy as jnp

        st = self.status()
        if not st.available:
            raise RuntimeError(f"{self.source.stem}: the native kernel is unavailable: {st.reason}")
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        out = jax.ShapeDtypeStruct((flat.shape[0], cols), jnp.float32)
        y = jax.ffi.ffi_call(target, out, vmap_method="sequential")(flat, *operands, **attrs)
        return y.reshape(lead + (cols,))


def rows_fit(x, max_rows: int) -> bool:
    """Whether ``x`` ``[..., K]`` has 1 to ``max_rows`` rows in all and is float32 (a decode kernel's call)."""
    import math

    import jax.numpy as jnp

    return 1 <= math.prod(x.shape[:-1]) <= max_rows and x.dtype == jnp.float32


CHOICES = ("auto", "xla", "native")


def resolve_cpu_kernel(requested: str, library: Library, *, key: str, backend: str | None = None, dtype=None,
                       devices: int | None = None) -> str:
    """``xla`` or ``native`` for a decode kernel's config key (``requested`` one of :data:`CHOICES`).

    ``auto`` is ``native`` on a single CPU device with float32 parameters (``dtype``; None:
    float32) when ``library`` builds, else ``xla``. ``native`` where it cannot run raises
    ``ValueError`` naming ``key`` and why; a value outside :data:`CHOICES` too.
    """
    import jax.numpy as jnp

    if requested not in CHOICES:
        raise ValueError(f"{key}={requested!r} is not one of {list(CHOICES)}")
    if requested == "xla":
        return "xla"
    backend = backend or jax.default_backend()
    devices = jax.device_count() if devices is None else devices
    why = None
    if backend != "cpu":
        why = f"runs on the CPU only (backend {backend!r})"
    elif dtype is not None and jnp.dtype(dtype) != jnp.dtype(jnp.float32):
        why = f"needs float32 parameters (model dtype {jnp.dtype(dtype).name})"
    elif devices != 1:
        why = f"runs on one device (this run has {devices}; the call is not partitioned)"
    else:
        st = library.status()
        if not st.available:
            why = f"kernel unavailable: {st.reason}"
    if why is None:
        return "native"
    if requested == "native":
        raise ValueError(f"{key}=native {why}; use auto or xla")
    return "xla"
