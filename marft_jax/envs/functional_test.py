"""One functional (HumanEval-style) test whose verdict the candidate cannot forge.

:func:`run_functional_test` starts two processes joined by two pipes:

* the **checker** (trusted): ``python -S -P trusted_checker.py`` as the scorer's user, with
  its own CPU, memory and core limits and an alarm, non-dumpable (no ptrace, no
  ``/proc/<pid>/mem``) when the candidate shares its uid. It receives the prompt and the test
  code on its standard input (never on disk, never on its command line), runs
  ``check(candidate)`` with a proxy ``candidate`` and writes the verdict on a third pipe that
  only the scorer holds;
* the **candidate**: the prompt, the answer and a small call server
  (``trusted_checker.candidate_source``) run by :func:`~marft_jax.envs.sandbox.run_program`
  with every containment of the sandbox, plus the two pipe ends it needs and with the
  dataset files in ``hide`` made unreadable.

Each call ``candidate(*args)`` in ``check()`` is a request/reply over the pipes carrying plain
data only (the wire format is in :mod:`marft_jax.envs.trusted_checker`). The test passes iff
``check()`` returns normally in the checker. The candidate's output, exit status and files
decide nothing; they only name the reason of a failure (e.g. ``timeout`` when the candidate
was killed at the time limit while a call was pending).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from marft_jax.envs import trusted_checker
from marft_jax.envs.sandbox import SandboxConfig, SandboxError, SandboxResult, run_program

# After the candidate's time limit, how long the checker may take to notice and report.
_GRACE_S = 1.0
_CANDIDATE_DIED = ("timeout", "memory", "file_limit", "output_limit", "crash")


@dataclasses.dataclass(frozen=True)
class FunctionalResult:
    """Outcome of one functional test.

    Attributes:
      status: ``ok`` (``check()`` returned normally) or why not: ``wrong`` (an assertion or
        another error of ``check()`` on the values returned), ``exception`` (the candidate
        raised and ``check()`` did not expect it), ``exited_early`` (the candidate ended
        before answering every call), ``timeout``, ``memory``, ``file_limit``,
        ``output_limit``, ``crash`` (the candidate died that way), ``bad_value`` (a result
        that is not plain data), ``protocol`` (a reply that does not answer the call),
        ``unsupported_argument`` / ``test_error`` (the dataset's test cannot be served or
        does not run), ``checker_error`` (the checker died without a verdict).
      elapsed_s: wall time of the test.
      calls: how many calls ``check()`` made.
      error: a short explanation (the failing line of the test, the candidate's stderr tail).
      enforced: the sandbox's ``enforced`` dict of the candidate's run.
    """

    status: str
    elapsed_s: float
    calls: int
    error: str | None
    enforced: dict[str, Any]


def _checker_env() -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _close(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    return b"".join(chunks)


def _status(verdict: dict[str, Any] | None, res: SandboxResult) -> str:
    if verdict is None:
        return res.status if res.status in _CANDIDATE_DIED else "checker_error"
    if verdict.get("passed") is True:
        return "ok"
    reason = verdict.get("reason")
    if reason == "exited":       # the candidate's pipe closed: say how the candidate ended
        return "exited_early" if res.status == "ok" else (
            res.status if res.status in _CANDIDATE_DIED else "crash")
    return str(reason)


def _run_pair(source: str, job: dict[str, Any], config: SandboxConfig, stderr: Any,
              hide: tuple[str, ...], start: float, fds: tuple[int, ...]
              ) -> tuple[dict[str, Any] | None, SandboxResult]:
    """Start the checker, run the candidate, collect the verdict (``None`` if there is none);
    every descriptor in ``fds`` is closed on return."""
    request_r, request_w, reply_r, reply_w, verdict_r, verdict_w = fds
    checker = None
    try:
        try:
            checker = subprocess.Popen(
                [sys.executable, "-S", "-P", trusted_checker.__file__], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=stderr, env=_checker_env(),
                cwd=tempfile.gettempdir(), close_fds=True, start_new_session=True,
                pass_fds=(request_w, reply_r, verdict_w))
        except OSError as e:
            _close(request_r, reply_w)
            raise SandboxError(f"cannot start the checker {sys.executable}: {e}") from e
        finally:
            _close(request_w, reply_r, verdict_w)
        try:
            checker.stdin.write(json.dumps(job).encode())
            checker.stdin.close()
        except OSError:
            pass                      # the checker died at start-up: no verdict (below)
        res = run_program(source, "", config, pass_fds=(request_r, reply_w),
                          stop_fd=verdict_r, hide=hide)
        try:
            checker.wait(timeout=max(0.0, start + config.timeout_s + _GRACE_S
                                     - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        raw = _read_all(verdict_r)
    finally:
        if checker is not None and checker.poll() is None:
            try:
                os.killpg(checker.pid, signal.SIGKILL)
            except OSError:
                pass
            checker.wait()
        _close(verdict_r)
    try:
        verdict = json.loads(raw) if raw else None
    except ValueError:
        verdict = None
    return (verdict if isinstance(verdict, dict) else None), res


def run_functional_test(program: str, test: str, entry_point: str, prefix: str = "",
                        config: SandboxConfig | None = None,
                        hide: tuple[str, ...] = ()) -> FunctionalResult:
    """Run ``check(entry_point)`` of ``test`` against ``program`` (module docstring).

    Args:
      program: the candidate's source (untrusted).
      test: the dataset's test code defining ``check(candidate)`` (trusted; never shown to
        the candidate).
      entry_point: the name of the function under test.
      prefix: the prompt: run before the program in the candidate, and before ``test`` in
        the checker (HumanEval tests may use its helpers).
      config: sandbox limits; ``timeout_s`` bounds the whole test.
      hide: paths unreadable to the candidate (the dataset files).

    Raises ``SandboxError`` only when the checker or the sandbox cannot start; whatever the
    candidate does is a status.
    """
    if os.name != "posix":
        raise SandboxError("functional tests need POSIX (pipes shared with the sandbox)")
    config = config or SandboxConfig()
    start = time.monotonic()
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    verdict_r, verdict_w = os.pipe()
    source = trusted_checker.candidate_source(program, prefix, entry_point, request_r, reply_w)
    job = {"prefix": prefix, "test": test, "entry_point": entry_point,
           "timeout_s": config.timeout_s, "cpu_s": math.ceil(config.timeout_s) + 1,
           "memory_bytes": max(2 << 30, 2 * config.memory_bytes), "parent_pid": os.getpid(),
           # only a root scorer runs the candidate as a uid of its own (sandbox docstring)
           "same_uid": not (hasattr(os, "geteuid") and os.geteuid() == 0
                            and config.drop_privileges),
           "site_paths": [p for p in sys.path
                          if os.path.basename(p) in ("site-packages", "dist-packages")],
           "request_fd": request_w, "reply_fd": reply_r, "verdict_fd": verdict_w}
    with tempfile.TemporaryFile() as stderr:
        verdict, res = _run_pair(source, job, config, stderr, hide, start,
                                 (request_r, request_w, reply_r, reply_w, verdict_r, verdict_w))
        status = _status(verdict, res)
        errors = []
        if verdict is None:
            stderr.seek(0)
            errors.append("checker: " + stderr.read()[-400:].decode("utf-8", "replace"))
        elif verdict.get("error"):
            errors.append(str(verdict["error"]))
    if status != "ok" and res.stderr.strip():
        errors.append("candidate stderr: " + res.stderr[-300:])
    return FunctionalResult(
        status=status, elapsed_s=time.monotonic() - start,
        calls=int(verdict.get("calls", 0)) if verdict else 0,
        error="\n".join(errors) if status != "ok" and errors else None,
        enforced=res.enforced)
