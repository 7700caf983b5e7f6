"""Files of Hugging Face Hub repositories, through ``huggingface_hub``'s own cache.

A model (``org/name``) or a dataset repository is fetched at a branch, tag or commit into the
standard cache (``$HF_HOME/hub``, ``models--org--name/snapshots/<commit>/``), or read from it
when it is already there. ``huggingface_hub`` reads ``HF_HOME``, ``HF_HUB_OFFLINE`` and
``HF_TOKEN`` itself; nothing here overrides them. In a multi-process run process 0 fetches
while the others wait at a barrier, then read the cache (and fetch for themselves only where
their cache is another disk). Any failure is a :class:`HubError` (a ``FileNotFoundError``, which
the CLI prints without a traceback) naming the repository, the revision and the ``hf download``
command that fetches the files.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path

# A Hub id: `org/name` (letters, digits, `-`, `_`, `.`), never a path that exists locally.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


class HubError(FileNotFoundError):
    """A Hub repository's files could not be had: absent offline, unknown, gated or unreachable."""


def is_repo_id(name: str) -> bool:
    """Whether ``name`` reads as a Hub repository id ``org/name`` (not ``./x``, ``/x``, ``~/x``
    or a ``.gguf`` file)."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith(".gguf")


def download_command(repo_id: str, revision: str, *, repo_type: str = "model",
                     files: Sequence[str] = (), patterns: Sequence[str] = ()) -> str:
    """The ``hf download`` command line that puts these files into the cache."""
    parts = ["hf", "download", repo_id, *files]
    if repo_type != "model":
        parts += ["--repo-type", repo_type]
    parts += ["--revision", revision]
    for p in patterns:
        parts += ["--include", p]
    return " ".join(shlex.quote(p) for p in parts)


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _explain(what: str, repo_id: str, revision: str, command: str, error: BaseException) -> HubError:
    """A :class:`HubError` for ``error`` (a ``huggingface_hub`` or network error)."""
    from huggingface_hub import errors

    fetch = (f"fetch it into the cache (HF_HOME) on a machine that reaches the Hub:\n  {command}\n"
             f"(`huggingface-cli download` with the same arguments on huggingface_hub < 1.0)")
    if isinstance(error, errors.GatedRepoError):
        return HubError(f"{what} {repo_id!r} is gated: accept its licence on https://huggingface.co/{repo_id}, "
                        f"then set HF_TOKEN (or run `hf auth login`) and {fetch}")
    if isinstance(error, errors.RevisionNotFoundError):
        return HubError(f"{what} {repo_id!r} has no revision {revision!r} on the Hub")
    if isinstance(error, errors.RepositoryNotFoundError):
        return HubError(f"{what} {repo_id!r} is not a Hub repository (or it is private: set HF_TOKEN), "
                        f"and no local file or directory has that name")
    if _offline():
        return HubError(f"{what} {repo_id!r} at revision {revision!r} is not in the Hugging Face cache "
                        f"({_cache_dir()}) and HF_HUB_OFFLINE=1 forbids downloading it; unset HF_HUB_OFFLINE "
                        f"or {fetch}")
    first = str(error).splitlines()[0] if str(error) else ""
    return HubError(f"{what} {repo_id!r} at revision {revision!r} could not be fetched "
                    f"({type(error).__name__}: {first}); {fetch}")


def _process_count() -> tuple[int, int]:
    import jax

    return jax.process_index(), jax.process_count()


def _barrier(name: str) -> None:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def fetch(what: str, repo_id: str, revision: str, get: Callable[[bool], Path], *, command: str) -> Path:
    """``get(local_files_only)`` (a ``huggingface_hub`` call) with the errors explained.

    Single process: ``get(False)`` (which reads the cache alone when ``HF_HUB_OFFLINE`` is set).
    Several processes: process 0 calls ``get(False)`` while the others wait at a barrier; then
    they call ``get(True)`` (the shared cache), and ``get(False)`` where that cache is not theirs.

    Raises:
      HubError: naming ``what``, the repository, the revision and ``command``.
    """
    hub_errors = Exception      # any failure of the Hub call (HTTP, network, cache, bad id) is explained
    index, count = _process_count()
    if count == 1:
        try:
            return get(False)
        except hub_errors as e:
            raise _explain(what, repo_id, revision, command, e) from e
    failure: BaseException | None = None
    if index == 0:
        try:
            path = get(False)
        except hub_errors as e:
            failure = e
    _barrier(f"marft_jax.hub {repo_id}@{revision}")
    if failure is not None:
        raise _explain(what, repo_id, revision, command, failure) from failure
    if index == 0:
        return path
    try:
        return get(True)
    except hub_errors:
        pass
    try:
        return get(False)
    except hub_errors as e:
        raise _explain(what, repo_id, revision, command, e) from e


def snapshot(what: str, repo_id: str, revision: str, patterns: Sequence[str], *,
             repo_type: str = "model") -> Path:
    """The cached snapshot folder of ``repo_id`` at ``revision`` holding the files matching
    ``patterns`` (downloaded unless ``HF_HUB_OFFLINE`` is set). Raises :class:`HubError`."""
    from huggingface_hub import snapshot_download

    def get(local_only: bool) -> Path:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision,
                                      allow_patterns=list(patterns), local_files_only=local_only))

    command = download_command(repo_id, revision, repo_type=repo_type, patterns=patterns)
    return fetch(what, repo_id, revision, get, command=command)


def file(what: str, repo_id: str, revision: str, filename: str, *, repo_type: str = "dataset") -> Path:
    """One file of ``repo_id`` at ``revision``, from the cache or downloaded into it.
    Raises :class:`HubError`."""
    from huggingface_hub import hf_hub_download

    def get(local_only: bool) -> Path:
        return Path(hf_hub_download(repo_id, filename, repo_type=repo_type, revision=revision,
                                    local_files_only=local_only))

    command = download_command(repo_id, revision, repo_type=repo_type, files=[filename])
    return fetch(what, repo_id, revision, get, command=command)
