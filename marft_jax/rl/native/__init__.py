"""Fused native CPU kernel for the Bellman backups, through the XLA FFI.

``backups_kernel.cc`` (next to this file) holds two FFI handlers, each computing a whole backup from
the raw inputs: validity (``dp_mask & step_mask``), per-response valid prefixes, the link
factors (terminal cuts, ``reference_semantics`` quirk #10), the row-end bootstrap value and
the advantages and returns, in one reverse pass per row on the ``[S, B, N, K]`` layout: the
chained/independent one (:func:`backup`) and the link-table one (:func:`backup_linked`, team
graphs with ``team.layer_links=layer``). The
jitted program of a native backup is therefore this one custom call (reshapes aside), which
XLA's CPU runtime executes inline on the calling thread instead of dispatching it to a worker
(it would for a program with enough other ops). The library is built
lazily, at the first :func:`status` call, with the system C++ compiler (``$CXX``, else ``c++``,
``g++`` or ``clang++``) into a per-user cache (``$MARFT_JAX_CACHE``, else
``$XDG_CACHE_HOME/marft_jax``, else ``~/.cache/marft_jax``) under a name keyed by the source,
the compile flags, the jaxlib version, the machine and the compiler's version. The build
writes a temporary file and renames it (atomic), so concurrent processes are safe; a cached
library is loaded without compiling. No ``-march``: the kernel picks its vector width at run
time (16 lanes with AVX-512F, 8 with AVX2+FMA, else 4).

Nothing here raises at import. When there is no compiler or the build fails, :func:`status`
reports ``available=False`` with the reason (the compiler's stderr tail) and the backups fall
back to the XLA implementations (``impl="auto"``).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax import native_build
from marft_jax.native_build import BASE_FLAGS, NativeUnavailable, cache_dir, find_compiler  # noqa: F401

SOURCE = Path(__file__).with_name("backups_kernel.cc")
FLAGS = BASE_FLAGS
TARGET, SYMBOL = "marft_backup", "MarftBackup"     # FFI target name, exported handler
LINKED_TARGET, LINKED_SYMBOL = "marft_backup_linked", "MarftBackupLinked"   # link-table backups


Status = native_build.Status
_library = native_build.Library(SOURCE, FLAGS, {TARGET: SYMBOL, LINKED_TARGET: LINKED_SYMBOL})


def library_path(cxx: str, directory: Path | None = None) -> Path:
    """The cache file of this kernel for ``cxx`` (see :func:`marft_jax.native_build.library_path`)."""
    return native_build.library_path(SOURCE, FLAGS, cxx, directory)


def build(directory: Path | None = None) -> tuple[Path, bool, float | None]:
    """Builds the library unless cached (:func:`marft_jax.native_build.build`)."""
    return native_build.build(SOURCE, FLAGS, directory)


def status() -> Status:
    """Builds (or finds cached), loads and registers the kernel once per process."""
    return _library.status()


def available() -> bool:
    return status().available


def require() -> Status:
    """:func:`status`, raising :class:`NativeUnavailable` with the reason if unavailable."""
    st = status()
    if not st.available:
        raise NativeUnavailable(f"the native backup kernel is unavailable: {st.reason}")
    return st


# ----------------------------------------------------------------------------------------------
# JAX wrappers. Calls are not partitioned (one device) and vmap runs them one at a time.


def backup(reward, value, dp_mask, step_mask, terminal, truncated, v_boot, *, gamma, lam,
           independent: bool, reference_semantics: bool = False,
           max_width: int = 0) -> tuple[jax.Array, jax.Array]:
    """A whole backup of :mod:`marft_jax.rl.backups` in one fused call (semantics there).

    Args:
      reward, value: ``[S, B, N, K]`` float (cast to float32 unless already); entries off
        valid points are never read on right-padded responses and never combined on the
        others: NaN there is harmless.
      dp_mask: ``[S, B, N, K]`` bool; the validity is ``dp_mask & step_mask``.
      step_mask, terminal, truncated: ``[S, B]`` bool.
      v_boot: ``[B]`` (chained) or ``[B*N]`` (independent, row ``b*N + i``) float.
      gamma, lam: discount and GAE lambda (Python floats or scalar arrays).
      independent: each agent's own sequence over steps instead of the chained order.
      reference_semantics: G1's quirk #10 links and bootstrap (chained only).
      max_width: cap on the vector width of the prefix path (4, 8 = AVX2, 16 = AVX-512; the
        widest the CPU supports below the cap is used); 0 = no cap. For tests.

    Returns:
      ``(advantages, returns)``, ``[S, B, N, K]`` float32, zero off valid points.
    """
    require()
    if independent and reference_semantics:
        raise ValueError("reference_semantics applies to the chained backup only")
    f32 = jnp.float32
    as_f32 = lambda x: x if x.dtype == f32 else x.astype(f32)
    as_bool = lambda x: x if x.dtype == jnp.bool_ else x.astype(bool)
    out = jax.ShapeDtypeStruct(value.shape, f32)
    call = jax.ffi.ffi_call(TARGET, (out, out), vmap_method="sequential")
    return call(as_f32(reward), as_f32(value), as_bool(dp_mask), as_bool(step_mask),
                as_bool(terminal), as_bool(truncated), as_f32(v_boot), jnp.asarray(gamma, f32),
                jnp.asarray(lam, f32), independent=np.int32(bool(independent)),
                reference_semantics=np.int32(bool(reference_semantics)),
                max_width=np.int32(max_width))


def backup_linked(reward, value, dp_mask, step_mask, terminal, truncated, v_boot, table, *, gamma, lam,
                  max_width: int = 0) -> tuple[jax.Array, jax.Array]:
    """The backup along a link table in one fused call (``backups.marft_gae(links=...)``).

    Args:
      reward, value, dp_mask, step_mask, terminal, truncated: as in :func:`backup`.
      v_boot: ``[B]`` float.
      table: ``[4, S*N]`` int32 (``backups.native_table``): the chunks' visiting order (each
        after its successor and skip target), successor, skip target, crossing flags (bit 0:
        the successor link leaves the step, bit 1: the skip link does).
      gamma, lam, max_width: as in :func:`backup`.

    Returns:
      ``(advantages, returns)``, ``[S, B, N, K]`` float32, zero off valid points.
    """
    require()
    f32 = jnp.float32
    as_f32 = lambda x: x if x.dtype == f32 else x.astype(f32)
    as_bool = lambda x: x if x.dtype == jnp.bool_ else x.astype(bool)
    out = jax.ShapeDtypeStruct(value.shape, f32)
    call = jax.ffi.ffi_call(LINKED_TARGET, (out, out), vmap_method="sequential")
    return call(as_f32(reward), as_f32(value), as_bool(dp_mask), as_bool(step_mask),
                as_bool(terminal), as_bool(truncated), as_f32(v_boot), jnp.asarray(table, jnp.int32),
                jnp.asarray(gamma, f32), jnp.asarray(lam, f32), max_width=np.int32(max_width))
