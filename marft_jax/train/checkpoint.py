"""Checkpoints of the trainable state (orbax), with integrity checks; PEFT export of the adapters.

What is saved: the whole :class:`~marft_jax.train.state.TrainState` (stacked LoRA, critic head
and critic LoRA, both optimizer states, step, RNG key) plus a small JSON ``extra`` dict (data
iterator position, config, the step's metrics). Never the frozen base: it is reloaded from its
own weights.

Layout of a run's checkpoint directory::

    <directory>/
      step_00000010/
        state/                 orbax StandardCheckpointHandler (OCDBT) of the state pytree
        extra.json             the caller's ``extra`` dict
        meta.json              format, step, per-leaf shape/dtype, PRNG key impls, LoRA scale
        MANIFEST.sha256.json   sha256 + size of every other file in the step directory
      .tmp-step_00000020-1a2b3c4d/   a save in progress (never listed, removed on start-up)

Atomicity: a save writes everything into a hidden ``.tmp-step_*`` sibling (orbax itself writes
``state`` as ``state.orbax-checkpoint-tmp`` and renames it when its commit completes), then writes
the manifest last, fsyncs, and renames the directory to ``step_<N>`` (``os.rename``: atomic on
one POSIX filesystem; local disks only, not object stores). A ``step_<N>`` directory therefore
only appears once complete; a crash or a full disk leaves at most a ``.tmp-*`` directory, which
is never picked up and is deleted by the next manager opened on the directory.

Integrity: ``restore`` re-hashes every file against the manifest before reading. A missing
manifest, a missing or changed file raises :class:`CheckpointCorruptError` naming it;
``restore(step=None)`` then warns and falls back to the next newest valid checkpoint. Corrupt
checkpoints are never deleted by the integrity check (only keep-last-k rotation deletes).

Async: with ``async_save=True`` (default), ``save`` returns once orbax has copied the arrays to
host memory (so the caller may donate or overwrite the state's buffers); the commit, manifest,
rename and rotation finish on a background thread. ``wait()`` blocks until then and re-raises a
background failure; the next ``save``/``restore`` calls ``wait()`` first. Single-process only
(multi-host would need orbax's barriers and one manifest writer).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
STATE_DIR = "state"
EXTRA_FILE = "extra.json"
META_FILE = "meta.json"
MANIFEST_FILE = "MANIFEST.sha256.json"
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-step_"
_TRASH_PREFIX = ".trash-step_"


class CheckpointCorruptError(RuntimeError):
    """A checkpoint directory is partial or fails its integrity check (names the file or dir)."""


class CheckpointMismatchError(ValueError):
    """A valid checkpoint does not fit the target state (different shapes, dtypes or LoRA scale)."""


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (e.g. disk full); earlier checkpoints are untouched."""


def step_dir_name(step: int) -> str:
    return f"step_{int(step):08d}"


# ----------------------------------------------------------------------------- file helpers

def _write_file(path: Path, data: bytes) -> None:
    """Write + fsync. Every non-orbax byte of a checkpoint goes through here (tests patch it)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files_under(root: Path) -> list[str]:
    """Relative POSIX paths of every regular file under ``root`` except the manifest."""
    out = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if rel != MANIFEST_FILE:
                out.append(rel)
    return sorted(out)


def write_manifest(step_dir: str | Path, step: int) -> Path:
    """Hash every file of ``step_dir`` into ``MANIFEST.sha256.json`` (written last)."""
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
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.eval_shape(jax.random.key_data, x)
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
    """Atomic, verified, rotated checkpoints of a TrainState under one directory.

    Args:
      directory: e.g. ``<run_dir>/checkpoints`` (created).
      keep_last: keep this many newest step directories (``None``: keep all).
      async_save: commit in the background (see module docstring).
    """

    def __init__(self, directory: str | Path, keep_last: int | None = 3, async_save: bool = True):
        import orbax.checkpoint as ocp

        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.directory = Path(directory).resolve()  # orbax requires absolute paths
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep_last = keep_last
        self.async_save = async_save
        handler = ocp.StandardCheckpointHandler()
        self._ckptr = ocp.AsyncCheckpointer(handler) if async_save else ocp.Checkpointer(handler)
        self._restorer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._clean_stale()

    # -- listing

    def all_steps(self) -> list[int]:
        """Steps with a committed ``step_<N>`` directory, ascending (not verified: see restore)."""
        steps = []
        for p in self.directory.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir():
                steps.append(int(m.group(1)))
        return sorted(steps)

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
        paths) or when a valid ``step`` already exists and ``force`` is False; ``force=True`` (or
        an existing step that fails its integrity check) replaces it atomically. Raises :class:`CheckpointSaveError` when writing fails (disk
        full...); in async mode a failure after this returns surfaces at ``wait()``.
        """
        self.wait()
        step = int(step)
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        extra_bytes = (json.dumps(_jsonable(dict(extra or {})), indent=1, sort_keys=True) + "\n").encode()
        bad = nonfinite_leaves(state)
        if bad:
            logger.error("refusing to save checkpoint step %d to %s: non-finite values in %s",
                         step, self.directory, ", ".join(bad[:8]) + (" ..." if len(bad) > 8 else ""))
            return False
        if self.step_path(step).exists() and not force:
            try:
                verify_manifest(self.step_path(step))
            except CheckpointCorruptError as e:  # e.g. resumed past it: a fresh save replaces it
                logger.warning("replacing corrupt checkpoint step %d: %s", step, e)
                force = True
            else:
                logger.warning("checkpoint step %d already exists in %s; not overwritten "
                               "(force=True replaces it)", step, self.directory)
                return False

        import orbax.checkpoint as ocp

        saveable, impls = _to_saveable(state)
        meta = {"format": FORMAT_VERSION, "step": step, "time": time.time(),
                "leaves": _leaf_specs(saveable), "key_impls": impls, "lora_scales": _lora_scales(state)}
        tmp = self.directory / f"{_TMP_PREFIX}{step:08d}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            _write_file(tmp / EXTRA_FILE, extra_bytes)
            _write_file(tmp / META_FILE, (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode())
            self._ckptr.save(tmp / STATE_DIR, args=ocp.args.StandardSave(saveable))
        except BaseException as e:
            self._abort(tmp)
            raise self._save_error(step, e) from e
        if self.async_save:
            self._thread = threading.Thread(target=self._finalize_bg, args=(step, tmp, force),
                                            name=f"ckpt-finalize-{step}", daemon=True)
            self._thread.start()
        else:
            self._finalize(step, tmp, force)
        return True

    def _finalize_bg(self, step: int, tmp: Path, force: bool) -> None:
        try:
            self._finalize(step, tmp, force)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait()
            self._error = e

    def _finalize(self, step: int, tmp: Path, force: bool) -> None:
        try:
            if self.async_save:
                self._ckptr.wait_until_finished()
            if not (tmp / STATE_DIR).is_dir():
                raise CheckpointSaveError(f"orbax did not commit {tmp / STATE_DIR}")
            write_manifest(tmp, step)
            _fsync_dir(tmp)
            final = self.step_path(step)
            old = None
            if final.exists():
                if not force:  # raced with another writer
                    raise FileExistsError(errno.EEXIST, "checkpoint step already exists", str(final))
                old = self.directory / f"{_TRASH_PREFIX}{step:08d}-{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
            try:
                os.rename(tmp, final)
            except BaseException:
                if old is not None:
                    os.rename(old, final)
                raise
            _fsync_dir(self.directory)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException as e:
            self._abort(tmp)
            raise self._save_error(step, e) from e
        logger.info("saved checkpoint %s", final)
        self._rotate(keep=step)

    def _save_error(self, step: int, e: BaseException) -> BaseException:
        if isinstance(e, CheckpointSaveError) or not isinstance(e, Exception):
            return e
        err = getattr(e, "errno", None)
        if err is None and isinstance(e.__cause__, OSError):
            err = e.__cause__.errno
        if err is None and "no space left on device" in str(e).lower():  # tensorstore wraps it
            err = errno.ENOSPC
        what = "disk full (ENOSPC)" if err == errno.ENOSPC else f"{type(e).__name__}: {e}"
        kept = self.all_steps()
        return CheckpointSaveError(err or errno.EIO,
                                   f"saving checkpoint step {step} failed: {what}; nothing was committed, "
                                   f"earlier checkpoints are untouched (steps {kept})", str(self.directory))

    def _abort(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def _rotate(self, keep: int) -> None:
        if self.keep_last is None:
            return
        steps = self.all_steps()
        doomed = [s for s in steps[:-self.keep_last] if s != keep]
        for s in doomed:
            trash = self.directory / f"{_TRASH_PREFIX}{s:08d}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(self.step_path(s), trash)  # never leave a half-deleted step_N behind
            except OSError as e:
                logger.warning("could not rotate out checkpoint %s: %s", self.step_path(s), e)
                continue
            shutil.rmtree(trash, ignore_errors=True)
            logger.info("deleted old checkpoint step %d (keep_last=%d)", s, self.keep_last)

    def _clean_stale(self) -> None:
        for p in self.directory.iterdir():
            if p.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                logger.warning("removing leftover partial checkpoint %s", p)
                shutil.rmtree(p, ignore_errors=True)

    def wait(self) -> None:
        """Block until a background save is committed; re-raise its failure."""
        t, self._thread = self._thread, None
        if t is not None:
            t.join()
        err, self._error = self._error, None
        if err is not None:
            raise err

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._ckptr.close()
            self._restorer.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- restore

    def restore(self, step: int | None = None, *, target_state: Any) -> tuple[Any, dict]:
        """Load ``(state, extra)``.

        Args:
          step: a step number, or None for the newest valid one (corrupt newer ones are skipped
            with a ``RuntimeWarning`` and kept on disk).
          target_state: a state of the same structure (concrete, or abstract from
            ``jax.eval_shape``); restored arrays take its shardings, and non-pytree fields (the
            LoRA ``scale``) come from it and must match what was saved.
        Raises:
          FileNotFoundError: no such step / no checkpoint at all.
          CheckpointCorruptError: the requested step (or every step) is partial or corrupt.
          CheckpointMismatchError: the checkpoint does not fit ``target_state``.
        """
        self.wait()
        if step is not None:
            path = self.step_path(step)
            if not path.is_dir():
                raise FileNotFoundError(f"no checkpoint step {step} in {str(self.directory)!r} "
                                        f"(available: {self.all_steps()})")
            return self._load(path, target_state)
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {str(self.directory)!r}")
        errors = []
        for s in reversed(steps):
            try:
                out = self._load(self.step_path(s), target_state)
            except CheckpointCorruptError as e:
                errors.append(str(e))
                warnings.warn(f"skipping corrupt checkpoint step {s}: {e}; falling back to an older one",
                              RuntimeWarning, stacklevel=2)
                continue
            return out
        raise CheckpointCorruptError(f"every checkpoint in {str(self.directory)!r} is corrupt: " + "; ".join(errors))

    def _load(self, path: Path, target_state: Any) -> tuple[Any, dict]:
        import orbax.checkpoint as ocp

        verify_manifest(path)
        try:
            meta = json.loads((path / META_FILE).read_text())
            extra = json.loads((path / EXTRA_FILE).read_text())
        except Exception as e:  # noqa: BLE001
            raise CheckpointCorruptError(f"checkpoint {str(path)!r}: cannot read {META_FILE}/{EXTRA_FILE} ({e!r})") from e
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
                                                sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
                return x
            return ocp.utils.to_shape_dtype_struct(x)

        try:
            restored = self._restorer.restore(path / STATE_DIR,
                                              args=ocp.args.StandardRestore(jax.tree.map(abstract, saveable)))
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
