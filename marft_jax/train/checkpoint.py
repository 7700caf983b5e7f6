"""Checkpoints of the trainable state on orbax's ``CheckpointManager``; PEFT export of the adapters.

What is saved: the whole :class:`~marft_jax.rl.state.TrainState` (stacked LoRA, critic head
and critic LoRA, both optimizer states, step, RNG key) plus a small JSON ``extra`` dict (data
iterator position, packing shapes, config, the step's metrics). Never the frozen base: it is
reloaded from its own weights.

Layout of a run's checkpoint directory (one orbax composite checkpoint per step)::

    <directory>/
      step_00000010/
        state/                 orbax StandardCheckpointHandler (OCDBT) of the state pytree
        extra/metadata         orbax JsonCheckpointHandler: the caller's ``extra`` dict
        meta/metadata          JSON: format, step, per-leaf shape/dtype, PRNG key impls, LoRA scale
        MANIFEST.sha256.json   sha256 + size of every file under state/, extra/, meta/
        _CHECKPOINT_METADATA   orbax's step metadata (and its commit_success.txt)
      step_00000020.orbax-checkpoint-tmp/   a save in progress (never listed, removed on open)

What orbax does: the atomic commit (every item is written into a ``*.orbax-checkpoint-tmp``
directory that the primary process renames to ``step_<N>`` once every process has committed
its shards), keep-last-k rotation (only after the new step committed),
removal of leftover temporary directories, the async commit on a background thread, and the
multi-process barriers: with ``jax.distributed`` every process calls ``save`` / ``restore``,
writes or reads its own shards, and orbax merges the per-process OCDBT files.

What we keep on top, and why:

* The integrity manifest. orbax checks neither the array payloads (OCDBT checksums its index
  nodes, but the zarr chunks carry no checksum: a flipped bit in ``state/`` restores silently as
  a wrong number, pinned by ``tests/test_checkpoint.py::test_orbax_alone_misses_a_flipped_bit``)
  nor the JSON items. The primary process writes the manifest inside the temporary directory
  just before orbax renames it (:class:`_ManifestTemporaryPath`, a subclass of orbax's
  atomic-rename path: local/POSIX filesystems, as before; object stores would need its
  commit-file variant), so a committed step always has one. ``restore`` re-hashes every listed
  file first (on every process: it reads the adapter-sized checkpoint once more): a missing
  manifest, a missing or changed file raises :class:`CheckpointCorruptError` naming it, and
  ``restore(step=None)`` warns and falls back to the next newest valid step. Corrupt steps are
  never deleted by the check.
* ``meta``: leaf shapes/dtypes and the static LoRA scale, so a checkpoint from another config
  is a :class:`CheckpointMismatchError` naming the leaves rather than an orbax shape error;
  typed PRNG keys are stored as their uint32 data with the impl name.
* Refusing non-finite states, and errors that say what happened (:class:`CheckpointSaveError`
  for a full disk, naming the steps that are still there).

Restoring onto another mesh: ``restore`` reads each leaf into the sharding of the target
(a concrete state's arrays, abstract ``jax.ShapeDtypeStruct`` leaves with ``sharding=``, or an
explicit ``shardings`` pytree), so a step saved from one device restores sharded over eight and
back.

Format 1 (the hand-written manager this replaced: ``state/`` beside ``extra.json`` and
``meta.json``) is still restored, so runs resume across the change.

Async: with ``async_save=True`` (default), ``save`` returns once orbax has copied the arrays to
host memory (so the caller may donate or overwrite the state's buffers); ``wait()`` blocks until
the commit and re-raises a background failure; the next ``save``/``restore`` calls it first.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.path import atomicity

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2      # 1: the hand-written manager before orbax's (state/ + extra.json + meta.json)
STATE_DIR = "state"     # orbax item names (one sub-directory each)
EXTRA_ITEM = "extra"
META_ITEM = "meta"
ITEMS = (STATE_DIR, EXTRA_ITEM, META_ITEM)
MANIFEST_FILE = "MANIFEST.sha256.json"
_V1_META, _V1_EXTRA = "meta.json", "extra.json"   # format 1 kept these beside state/ (still read)
STEP_PREFIX = "step"
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointCorruptError(RuntimeError):
    """A checkpoint directory is partial or fails its integrity check (names the file or dir)."""


class CheckpointMismatchError(ValueError):
    """A valid checkpoint does not fit the target state (different shapes, dtypes or LoRA scale)."""


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (e.g. disk full); earlier checkpoints are untouched."""


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}_{int(step):08d}"


# ----------------------------------------------------------------------------- the manifest

def _write_file(path: Path, data: bytes) -> None:
    """Write + fsync (the manifest goes through here; tests patch it)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files_under(root: Path) -> list[str]:
    """Relative POSIX paths of every regular file in the item directories of ``root``."""
    out = []
    for item in ITEMS:
        for dirpath, _, files in os.walk(root / item):
            out.extend((Path(dirpath) / name).relative_to(root).as_posix() for name in files)
    return sorted(out)


def write_manifest(step_dir: str | Path, step: int) -> Path:
    """Hash every item file of ``step_dir`` into ``MANIFEST.sha256.json``."""
    step_dir = Path(step_dir)
    files = {rel: {"sha256": _sha256(step_dir / rel), "size": (step_dir / rel).stat().st_size}
             for rel in _files_under(step_dir)}
    manifest = {"format": FORMAT_VERSION, "step": int(step), "files": files}
    path = step_dir / MANIFEST_FILE
    _write_file(path, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return path


def verify_manifest(step_dir: str | Path) -> dict:
    """Check every file of ``step_dir`` against its manifest; returns the manifest.

    Raises :class:`CheckpointCorruptError` naming the manifest or the first bad file.
    """
    step_dir = Path(step_dir)
    mpath = step_dir / MANIFEST_FILE
    if not step_dir.is_dir():
        raise CheckpointCorruptError(f"checkpoint {str(step_dir)!r} is not a directory")
    if not mpath.is_file():
        raise CheckpointCorruptError(
            f"checkpoint {str(step_dir)!r} has no {MANIFEST_FILE}: partial or interrupted save")
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        assert isinstance(files, dict) and files
    except Exception as e:  # noqa: BLE001 - any parse problem means a bad manifest
        raise CheckpointCorruptError(f"checkpoint manifest {str(mpath)!r} is unreadable ({e!r})") from e
    for rel, rec in sorted(files.items()):
        p = step_dir / rel
        if not p.is_file():
            raise CheckpointCorruptError(f"checkpoint file {str(p)!r} is missing (listed in {MANIFEST_FILE})")
        size = p.stat().st_size
        if size != rec["size"]:
            raise CheckpointCorruptError(
                f"checkpoint file {str(p)!r} has {size} bytes, manifest says {rec['size']}")
        if _sha256(p) != rec["sha256"]:
            raise CheckpointCorruptError(f"checkpoint file {str(p)!r} fails its sha256 check")
    extra_files = sorted(set(_files_under(step_dir)) - set(files))
    if extra_files:
        logger.warning("checkpoint %s holds files not in its manifest (ignored): %s", step_dir, extra_files)
    return manifest


class _ManifestTemporaryPath(atomicity.AtomicRenameTemporaryPath):
    """orbax's atomic-rename directory, with the manifest written just before the rename.

    orbax calls ``finalize`` of the step directory on the primary process only, after every
    process's shards are committed and the handlers finalized (item directories renamed, the
    OCDBT merge), so the manifest sees the final files.
    """

    async def finalize(self, *args, **kwargs):
        m = _STEP_RE.match(self.get_final().name)
        if m:  # the step directory (orbax also uses this class for each item's directory)
            await asyncio.to_thread(write_manifest, Path(self.get()), int(m.group(1)))
        return await super().finalize(*args, **kwargs)


# ----------------------------------------------------------------------------- pytree helpers

def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_impl_name(x: Any) -> str | None:
    """The PRNG impl name of a concrete key array (None for abstract ones)."""
    try:
        return str(jax.random.key_impl(x))
    except Exception:  # noqa: BLE001 - ShapeDtypeStruct targets
        return None


def _to_saveable(tree: Any) -> tuple[Any, dict[str, str]]:
    """Replace typed PRNG keys by their uint32 data; return the impl name of each by leaf path."""
    impls: dict[str, str] = {}

    def conv(path, x):
        if _is_key(x):
            name = _key_impl_name(x)
            if name is not None:
                impls[jax.tree_util.keystr(path)] = name
            if isinstance(x, jax.ShapeDtypeStruct):  # keep a target sharding (restore onto a mesh)
                data = jax.eval_shape(jax.random.key_data, x)
                return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(x, "sharding", None))
            return jax.random.key_data(x)
        return x

    return jax.tree_util.tree_map_with_path(conv, tree), impls


def _leaf_specs(tree: Any) -> dict[str, list]:
    return {jax.tree_util.keystr(p): [list(np.shape(x)), str(np.dtype(x.dtype))]
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _lora_scales(tree: Any) -> dict[str, float]:
    """Static LoRA ``scale`` fields (not pytree leaves, so orbax does not store them)."""
    from marft_jax.models.lora import LoraStack

    out: dict[str, float] = {}
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, LoraStack))[0]
    for p, x in leaves:
        if isinstance(x, LoraStack):
            out[jax.tree_util.keystr(p)] = float(x.scale)
    return out


@jax.jit
def _all_finite(leaves: list) -> list:
    return [jnp.all(jnp.isfinite(x)) for x in leaves]


def nonfinite_leaves(tree: Any) -> list[str]:
    """Paths of floating-point leaves holding a NaN or an infinity (one jitted call, one sync)."""
    paths, leaves = [], []
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if hasattr(x, "dtype") and not _is_key(x) and jnp.issubdtype(x.dtype, jnp.inexact):
            paths.append(jax.tree_util.keystr(p))
            leaves.append(x)
    flags = jax.device_get(_all_finite(leaves)) if leaves else []
    return [p for p, ok in zip(paths, flags) if not bool(ok)]


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        a = np.asarray(jax.device_get(x))
        return a.item() if a.ndim == 0 else a.tolist()
    if isinstance(x, Path):
        return str(x)
    return x


# ----------------------------------------------------------------------------- the manager

class CheckpointManager:
    """Verified, rotated checkpoints of a TrainState under one directory (orbax underneath).

    Multi-process: every process constructs the manager and calls ``save``/``restore``/
    ``wait``/``close`` in the same order (orbax's barriers pair them up).

    Args:
      directory: e.g. ``<run_dir>/checkpoints`` (created).
      keep_last: keep this many newest steps (``None``: keep all).
      async_save: commit in the background (see module docstring).
      read_only: only list and restore (``save`` raises); leaves a concurrent writer's temporary
        directories alone (e.g. evaluating a run while it trains).
    """

    def __init__(self, directory: str | Path, keep_last: int | None = 3, async_save: bool = True,
                 read_only: bool = False):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.directory = Path(directory).resolve()  # orbax requires absolute paths
        self.keep_last = keep_last
        self.async_save = async_save
        self.read_only = read_only
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep_last, step_prefix=STEP_PREFIX, step_format_fixed_length=8,
            enable_async_checkpointing=async_save, cleanup_tmp_directories=not read_only,
            temporary_path_class=_ManifestTemporaryPath, save_root_metadata=False, read_only=read_only,
            create=not read_only)
        self._mgr = ocp.CheckpointManager(self.directory, item_names=ITEMS, options=options)
        self._pending: int | None = None

    # -- listing

    def all_steps(self) -> list[int]:
        """Steps with a committed ``step_<N>`` directory, ascending (not verified: see restore)."""
        self._mgr.reload()  # the directory may have changed under us (another manager, a user)
        return sorted(int(s) for s in self._mgr.all_steps())

    def latest_step(self, verify: bool = False) -> int | None:
        """Newest committed step (``verify=True``: newest whose manifest checks out), or None."""
        for s in reversed(self.all_steps()):
            if not verify:
                return s
            try:
                verify_manifest(self.step_path(s))
                return s
            except CheckpointCorruptError:
                continue
        return None

    def step_path(self, step: int) -> Path:
        return self.directory / step_dir_name(step)

    # -- save

    def save(self, step: int, state: Any, extra: Mapping[str, Any] | None = None,
             force: bool = False) -> bool:
        """Save ``state`` (+ JSON ``extra``) as step ``step``.

        Returns False, writing nothing, when a floating leaf is non-finite (logged with the leaf
        paths) or when a valid ``step`` already exists and ``force`` is False. ``force=True``, or
        an existing step that fails its integrity check, deletes that step and saves it anew
        (not atomic for that one step: orbax cannot overwrite; other steps are untouched).
        Raises :class:`CheckpointSaveError` when writing fails (disk full...); in async mode a
        failure after this returns surfaces at ``wait()``.
        """
        if self.read_only:
            raise ValueError(f"checkpoint manager on {str(self.directory)!r} is read-only: cannot save step {step}")
        self.wait()
        step = int(step)
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        extra = _jsonable(dict(extra or {}))
        json.dumps(extra)  # not JSON-able: fail here, before anything is written
        bad = nonfinite_leaves(state)
        if bad:
            logger.error("refusing to save checkpoint step %d to %s: non-finite values in %s",
                         step, self.directory, ", ".join(bad[:8]) + (" ..." if len(bad) > 8 else ""))
            return False
        if step in self.all_steps():
            if not force:
                try:
                    verify_manifest(self.step_path(step))
                except CheckpointCorruptError as e:  # e.g. resumed past it: a fresh save replaces it
                    logger.warning("replacing corrupt checkpoint step %d: %s", step, e)
                else:
                    logger.warning("checkpoint step %d already exists in %s; not overwritten "
                                   "(force=True replaces it)", step, self.directory)
                    return False
            self._mgr.delete(step)

        saveable, impls = _to_saveable(state)
        meta = {"format": FORMAT_VERSION, "step": step, "time": time.time(),
                "leaves": _leaf_specs(saveable), "key_impls": impls, "lora_scales": _lora_scales(state)}
        args = ocp.args.Composite(**{STATE_DIR: ocp.args.StandardSave(saveable),
                                     EXTRA_ITEM: ocp.args.JsonSave(extra),
                                     META_ITEM: ocp.args.JsonSave(meta)})
        self._pending = step
        try:
            self._mgr.save(step, args=args, force=True)
            if not self.async_save:
                self._mgr.wait_until_finished()
        except BaseException as e:
            self._failed(step, e)
        if not self.async_save:
            self._pending = None
            logger.info("saved checkpoint %s", self.step_path(step))
        return True

    def _failed(self, step: int, e: BaseException):
        """Remove what the failed save of ``step`` left and raise a :class:`CheckpointSaveError`."""
        self._pending = None
        if step is None:
            raise e
        if jax.process_index() == 0:
            for p in self.directory.glob(step_dir_name(step) + atomicity.TMP_DIR_SUFFIX + "*"):
                shutil.rmtree(p, ignore_errors=True)
        self._mgr.reload()
        if isinstance(e, CheckpointSaveError) or not isinstance(e, Exception):
            raise e
        err = None
        for x in (e, e.__cause__, e.__context__):
            err = err or getattr(x, "errno", None)
        if err is None and "no space left on device" in str(e).lower():  # tensorstore wraps it
            err = errno.ENOSPC
        what = "disk full (ENOSPC)" if err == errno.ENOSPC else f"{type(e).__name__}: {e}"
        raise CheckpointSaveError(err or errno.EIO,
                                  f"saving checkpoint step {step} failed: {what}; nothing was committed, "
                                  f"earlier checkpoints are untouched (steps {self.all_steps()})",
                                  str(self.directory)) from e

    def wait(self) -> None:
        """Block until a background save is committed; re-raise its failure."""
        step = self._pending
        try:
            self._mgr.wait_until_finished()
        except BaseException as e:
            self._failed(step, e)
        if step is not None:
            self._pending = None
            logger.info("saved checkpoint %s", self.step_path(step))

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._mgr.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- restore

    def restore(self, step: int | None = None, *, target_state: Any,
                shardings: Any = None) -> tuple[Any, dict]:
        """Load ``(state, extra)``.

        Args:
          step: a step number, or None for the newest valid one (corrupt newer ones are skipped
            with a ``RuntimeWarning`` and kept on disk).
          target_state: a state of the same structure (concrete, or abstract from
            ``jax.eval_shape``); restored arrays take its shardings (abstract leaves without one:
            the first local device), and non-pytree fields (the LoRA ``scale``) come from it and
            must match what was saved.
          shardings: optional pytree of ``jax.sharding.Sharding`` with the structure of
            ``target_state``; overrides its shardings (restore onto another mesh).
        Raises:
          FileNotFoundError: no such step / no checkpoint at all.
          CheckpointCorruptError: the requested step (or every step) is partial or corrupt.
          CheckpointMismatchError: the checkpoint does not fit ``target_state``.
        """
        self.wait()
        if shardings is not None:
            target_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                        target_state, shardings)
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(f"no checkpoint step {step} in {str(self.directory)!r} "
                                        f"(available: {steps})")
            return self._load(step, target_state)
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {str(self.directory)!r}")
        errors = []
        for s in reversed(steps):
            try:
                return self._load(s, target_state)
            except CheckpointCorruptError as e:
                errors.append(str(e))
                warnings.warn(f"skipping corrupt checkpoint step {s}: {e}; falling back to an older one",
                              RuntimeWarning, stacklevel=2)
        raise CheckpointCorruptError(f"every checkpoint in {str(self.directory)!r} is corrupt: " + "; ".join(errors))

    def _load(self, step: int, target_state: Any) -> tuple[Any, dict]:
        path = self.step_path(step)
        verify_manifest(path)
        legacy = (path / _V1_META).is_file() and not (path / META_ITEM).is_dir()
        try:
            if legacy:  # format 1: plain JSON files beside an orbax state directory
                meta, extra = (json.loads((path / f).read_text()) for f in (_V1_META, _V1_EXTRA))
            else:
                js = self._mgr.restore(step, args=ocp.args.Composite(**{EXTRA_ITEM: ocp.args.JsonRestore(),
                                                                        META_ITEM: ocp.args.JsonRestore()}))
                extra, meta = dict(js[EXTRA_ITEM]), dict(js[META_ITEM])
        except Exception as e:  # noqa: BLE001 - verified files that cannot be read: corrupt
            raise CheckpointCorruptError(f"checkpoint {str(path)!r}: cannot read its {META_ITEM} / "
                                         f"{EXTRA_ITEM} JSON ({e!r})") from e
        saveable, _ = _to_saveable(target_state)
        want, have = _leaf_specs(saveable), meta.get("leaves", {})
        if want != have:
            diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
            raise CheckpointMismatchError(
                f"checkpoint {str(path)!r} does not fit the target state; differing leaves: "
                + ", ".join(f"{k}: saved {have.get(k)} vs target {want.get(k)}" for k in diff[:6]))
        scales = _lora_scales(target_state)
        if scales != meta.get("lora_scales", scales):
            raise CheckpointMismatchError(f"checkpoint {str(path)!r}: LoRA scale {meta['lora_scales']} "
                                          f"!= target {scales} (lora.alpha / lora.rank changed?)")

        def abstract(x):
            if isinstance(x, jax.ShapeDtypeStruct):
                if getattr(x, "sharding", None) is None:
                    return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
                return x
            return ocp.utils.to_shape_dtype_struct(x)

        try:
            target = jax.tree.map(abstract, saveable)
            if legacy:
                with ocp.StandardCheckpointer() as reader:
                    restored = reader.restore(path / STATE_DIR, target)
            else:
                restored = self._mgr.restore(step, args=ocp.args.Composite(
                    **{STATE_DIR: ocp.args.StandardRestore(target)}))[STATE_DIR]
        except Exception as e:  # noqa: BLE001 - verified files that orbax cannot read: corrupt
            raise CheckpointCorruptError(f"checkpoint {str(path / STATE_DIR)!r}: orbax restore failed ({e!r})") from e

        impls = meta.get("key_impls", {})
        tgt_leaves = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(target_state)[0]}

        def back(p, x):
            k = jax.tree_util.keystr(p)
            t = tgt_leaves.get(k)
            if t is not None and _is_key(t):
                impl = impls.get(k) or _key_impl_name(t)
                t_impl = _key_impl_name(t)
                if t_impl is not None and impl != t_impl:
                    raise CheckpointMismatchError(f"checkpoint {str(path)!r}: PRNG impl {impl} != target {t_impl}")
                return jax.random.wrap_key_data(x, impl=impl) if impl else jax.random.wrap_key_data(x)
            return x

        state = jax.tree_util.tree_map_with_path(back, restored)
        return state, extra


# ----------------------------------------------------------------------------- PEFT export

def _safe_role(role: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", str(role)).strip("-") or "role"


def export_adapters(state: Any, out_dir: str | Path, base_model_name: str,
                    roles: Sequence[str] | None = None) -> list[Path]:
    """Export every agent's adapter as a PEFT folder ``out_dir/agent{i}_{role}/``.

    Args:
      state: a TrainState (its ``lora``) or a LoraStack ``[agent, ...]``.
      roles: one name per agent (sanitised for the filesystem); None: folders ``agent{i}``.
    Returns the folders, in agent order. Each is written atomically by
    :func:`marft_jax.models.peft_io.export_peft`.
    """
    from marft_jax.models.peft_io import export_peft

    lora = getattr(state, "lora", state)
    n = lora.num_agents
    if roles is not None and len(roles) != n:
        raise ValueError(f"export_adapters: {len(roles)} role names for {n} agents")
    out_dir = Path(out_dir)
    paths = []
    for i in range(n):
        name = f"agent{i}" if roles is None else f"agent{i}_{_safe_role(roles[i])}"
        paths.append(export_peft(lora, i, out_dir / name, base_model_name))
    return paths
