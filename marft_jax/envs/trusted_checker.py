"""The trusted side of a functional (HumanEval-style) test, and the plain-data wire format.

A functional test is ``check(candidate)`` code from the dataset. The candidate program runs in
the sandbox; ``check()`` runs here, in a separate trusted process (``python -S -P
trusted_checker.py``, started by :mod:`marft_jax.envs.functional_test`) that the candidate
cannot reach. ``check()`` receives a proxy as ``candidate``: each call sends the arguments over
a pipe to a small server appended to the candidate program (:func:`candidate_source`), which
calls the candidate's function and sends back the result. The verdict is whether ``check()``
returned normally, decided here; nothing the candidate prints or writes counts.

Wire format (both directions): a frame is an 8-byte big-endian length and a JSON document.
Values are *plain data*: ``None``, ``bool``, ``int``, ``float`` (``NaN``/``Infinity``
allowed), ``str`` and ``list`` as JSON, and ``{"tuple": [...]}``, ``{"set": [...]}``,
``{"dict": [[key, value], ...]}`` for the others. :func:`decode` accepts nothing else: no JSON
object other than those three tags, no subclass of a builtin, no ``frozenset``, ``bytes`` or
``complex``. ``bool`` stays distinct from ``int`` on the wire; ``check()`` then compares with
Python's own ``==``, so ``True == 1`` and ``2 == 2.0`` hold as in the reference HumanEval
harness. A request is ``{"id": nonce, "args": [...], "kwargs": {"dict": ...}}`` with a fresh
random nonce per call; the reply is ``{"id": nonce, "value": v}``, ``{"id": nonce, "raise":
[exception type name, message]}`` or ``{"id": nonce, "bad": type name}`` (the result is not
plain data). A reply with another nonce, a malformed frame, a frame over
:data:`MAX_FRAME_BYTES`, a result that is not plain data, EOF, or no reply before the deadline
fails the test; so does anything the candidate sends ahead of time, since it cannot know the
next nonce. The candidate can still read each request (it may rewrite the server), so it can
only pass by returning the right values.

This module imports only the standard library: it is the checker process's program.
"""

from __future__ import annotations

import builtins
import json
import os
import select
import sys
import time

# No ``typing``: this is the checker process's program and each import costs start-up time.

MAX_FRAME_BYTES = 16 << 20
_HEADER = 8
_TAGS = ("tuple", "set", "dict")


class NotPlainData(ValueError):
    """A value (or wire document) that is not plain data."""


def to_wire(value: object) -> object:
    """``value`` as a JSON-ready tree (module docstring); ``NotPlainData`` otherwise.

    Types are checked exactly (``type(x) is int``), so subclasses are refused.
    """
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [to_wire(v) for v in value]
    if kind is tuple:
        return {"tuple": [to_wire(v) for v in value]}
    if kind is set:
        return {"set": [to_wire(v) for v in value]}
    if kind is dict:
        return {"dict": [[to_wire(k), to_wire(v)] for k, v in value.items()]}
    raise NotPlainData(f"not plain data: {kind.__name__}")


def from_wire(tree: object) -> object:
    """The plain value of a tree parsed by ``json.loads``; ``NotPlainData`` for anything else
    (an untagged object, an unknown tag, an unhashable set member or dict key)."""
    kind = type(tree)
    if tree is None or kind in (bool, int, float, str):
        return tree
    if kind is list:
        return [from_wire(v) for v in tree]
    if kind is dict and len(tree) == 1:
        (tag, items), = tree.items()
        if tag in _TAGS and type(items) is list:
            try:
                if tag == "tuple":
                    return tuple(from_wire(v) for v in items)
                if tag == "set":
                    return {from_wire(v) for v in items}
                pairs = [(from_wire(p[0]), from_wire(p[1])) for p in items
                         if type(p) is list and len(p) == 2]
                if len(pairs) != len(items):
                    raise NotPlainData("a dict entry is not a [key, value] pair")
                return dict(pairs)
            except TypeError as e:              # unhashable member or key
                raise NotPlainData(str(e)) from None
    raise NotPlainData(f"not a plain-data document: {kind.__name__}")


def encode(value: object) -> bytes:
    """Plain data -> JSON bytes."""
    return json.dumps(to_wire(value), allow_nan=True).encode()


def decode(data: bytes) -> object:
    """JSON bytes -> plain data (strict; ``NotPlainData`` on any error)."""
    try:
        return from_wire(json.loads(data))
    except NotPlainData:
        raise
    except (ValueError, RecursionError, MemoryError, UnicodeDecodeError) as e:
        raise NotPlainData(f"malformed document: {type(e).__name__}: {str(e)[:200]}") from None


# --------------------------------------------------------------------------- candidate side

# Appended to the candidate program (after the prompt and the answer). It is untrusted like
# the rest of the program: the checker trusts only the values it receives.
_SERVER = r'''

def __marft_serve(entry, rfd, wfd):
    import json, os
    def read(n):
        buf = b""
        while len(buf) < n:
            chunk = os.read(rfd, n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf
    def enc(x):
        t = type(x)
        if x is None or t in (bool, int, float, str):
            return x
        if t is list:
            return [enc(v) for v in x]
        if t is tuple:
            return {"tuple": [enc(v) for v in x]}
        if t is set:
            return {"set": [enc(v) for v in x]}
        if t is dict:
            return {"dict": [[enc(k), enc(v)] for k, v in x.items()]}
        raise TypeError("__marft_not_plain__:" + t.__name__)
    def dec(x):
        if type(x) is list:
            return [dec(v) for v in x]
        if type(x) is dict:
            (tag, items), = x.items()
            if tag == "tuple":
                return tuple(dec(v) for v in items)
            if tag == "set":
                return {dec(v) for v in items}
            return {dec(k): dec(v) for k, v in items}
        return x
    fn = globals()[entry]
    while True:
        head = read(8)
        if head is None:
            return
        req = json.loads(read(int.from_bytes(head, "big")))
        reply = {"id": req["id"]}
        try:
            result = fn(*dec(req["args"]), **dec(req["kwargs"]))
            try:
                reply["value"] = enc(result)
            except TypeError as e:
                reply["bad"] = str(e)
        except BaseException as e:
            try:
                message = str(e)[:1000]
            except BaseException:
                message = "?"
            reply["raise"] = [type(e).__name__, message]
        data = json.dumps(reply).encode()
        data = len(data).to_bytes(8, "big") + data
        while data:
            data = data[os.write(wfd, data):]

__marft_serve(%(entry)r, %(rfd)d, %(wfd)d)
'''


def candidate_source(program: str, prefix: str, entry_point: str, request_fd: int,
                     reply_fd: int) -> str:
    """The candidate's ``main.py``: ``from __future__`` lines of ``program`` first, then the
    prompt ``prefix`` (imports and helpers; a body-only answer completes its function, a full
    definition replaces its stub), the answer, and the call server. No test code."""
    lines = program.splitlines()
    future = [ln for ln in lines if ln.startswith("from __future__ import")]
    body = "\n".join(ln for ln in lines if not ln.startswith("from __future__ import"))
    head = "\n".join(future) + "\n" if future else ""
    server = _SERVER % {"entry": entry_point, "rfd": request_fd, "wfd": reply_fd}
    return f"{head}{prefix}\n{body}\n{server}"


# --------------------------------------------------------------------------- trusted side


class CandidateFailed(BaseException):
    """The candidate died, stalled, broke the protocol or returned something that is not plain
    data. A ``BaseException`` so that a test's ``except Exception`` cannot swallow it (a bare
    ``except`` can, so the failure is also recorded on the proxy)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


class ArgumentNotPlain(Exception):
    """``check()`` passed the candidate an argument that is not plain data (a dataset the
    checker cannot serve)."""


class _Proxy:
    """The ``candidate`` that ``check()`` calls: one request/reply per call, under a deadline."""

    def __init__(self, request_fd: int, reply_fd: int, deadline: float) -> None:
        self.request_fd, self.reply_fd, self.deadline = request_fd, reply_fd, deadline
        os.set_blocking(request_fd, False)
        self.failure: CandidateFailed | None = None
        self.calls = 0

    def _fail(self, reason: str, detail: str = "") -> CandidateFailed:
        if self.failure is None:
            self.failure = CandidateFailed(reason, detail)
        return self.failure

    def _read(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self.reply_fd], [], [], left)[0]:
                raise self._fail("timeout", f"no reply within the time limit (call {self.calls})")
            chunk = os.read(self.reply_fd, min(n - len(buf), 1 << 20))
            if not chunk:
                raise self._fail("exited", f"the candidate closed the pipe (call {self.calls})")
            buf += chunk
        return bytes(buf)

    def __call__(self, *args: object, **kwargs: object) -> object:
        if self.failure is not None:
            raise self.failure
        self.calls += 1
        try:
            payload = {"args": to_wire(list(args)), "kwargs": to_wire(dict(kwargs))}
        except NotPlainData as e:
            raise ArgumentNotPlain(f"check() passed the candidate {e}") from None
        nonce = os.urandom(16).hex()
        payload["id"] = nonce
        data = json.dumps(payload, allow_nan=True).encode()
        data = len(data).to_bytes(_HEADER, "big") + data
        try:
            while data:
                if not select.select([], [self.request_fd], [],
                                     max(0.0, self.deadline - time.monotonic()))[1]:
                    raise self._fail("timeout", "the candidate does not read its requests")
                try:
                    data = data[os.write(self.request_fd, data):]
                except BlockingIOError:
                    continue
        except OSError as e:
            raise self._fail("exited", f"cannot send the call: {e}") from None
        size = int.from_bytes(self._read(_HEADER), "big")
        if size > MAX_FRAME_BYTES:
            raise self._fail("protocol", f"reply of {size} bytes (limit {MAX_FRAME_BYTES})")
        try:
            reply = json.loads(self._read(size))
        except (ValueError, RecursionError, UnicodeDecodeError) as e:
            raise self._fail("protocol", f"malformed reply ({type(e).__name__})") from None
        if type(reply) is not dict or reply.get("id") != nonce or len(reply) != 2:
            raise self._fail("protocol", "a reply that does not answer this call")
        if "value" in reply:
            try:
                return from_wire(reply["value"])
            except (NotPlainData, RecursionError) as e:
                raise self._fail("bad_value", str(e)[:200]) from None
        if "raise" in reply:
            raise self._candidate_exception(reply["raise"])
        if "bad" in reply:
            raise self._fail("bad_value", str(reply["bad"])[:200])
        raise self._fail("protocol", "a reply without value, raise or bad")

    def _candidate_exception(self, spec: object) -> BaseException:
        """The candidate's own exception, re-raised here as the builtin ``Exception`` subclass
        of that name (so a test that expects e.g. ``ValueError`` sees one); any other kind
        (``SystemExit``, a custom class) becomes ``RuntimeError``."""
        if not (type(spec) is list and len(spec) == 2 and all(type(s) is str for s in spec)):
            return self._fail("protocol", "malformed exception reply")
        name, message = spec[0][:100], spec[1][:1000]
        cls = getattr(builtins, name, None)
        exc: BaseException | None = None
        if (isinstance(cls, type) and issubclass(cls, Exception)
                and not issubclass(cls, (StopIteration, StopAsyncIteration))):
            try:
                exc = cls(message)
            except Exception:
                exc = None
        if exc is None:
            exc = RuntimeError(f"{name}: {message}")
        exc.marft_from_candidate = True  # type: ignore[attr-defined]
        return exc


def run_check(job: dict[str, object], request_fd: int, reply_fd: int) -> dict[str, object]:
    """Run the job's ``check(candidate)`` against the proxy; the verdict as a dict:
    ``passed``, ``reason`` (``None`` when passed; ``wrong``, ``exception``, ``exited``,
    ``timeout``, ``protocol``, ``bad_value``, ``unsupported_argument``, ``test_error``),
    ``error`` (a short explanation) and ``calls``."""
    proxy = _Proxy(request_fd, reply_fd, time.monotonic() + float(job["timeout_s"]))
    ns: dict[str, object] = {"__name__": "__marft_check__"}
    try:
        exec(compile(job["prefix"], "<prompt>", "exec"), ns)
        exec(compile(job["test"], "<test>", "exec"), ns)
        check = ns["check"]
    except BaseException:
        import traceback
        return {"passed": False, "reason": "test_error", "calls": 0,
                "error": traceback.format_exc(limit=2)[-600:]}
    ns[job["entry_point"]] = proxy   # a test that names the function gets the candidate too
    reason, error = None, None
    try:
        check(proxy)
    except CandidateFailed as e:
        reason, error = e.reason, e.detail
    except ArgumentNotPlain as e:
        reason, error = "unsupported_argument", str(e)
    except BaseException as e:
        import linecache
        import traceback
        for filename, text in (("<prompt>", job["prefix"]), ("<test>", job["test"])):
            # so that the failing line of the test appears in the error
            linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        reason = "exception" if getattr(e, "marft_from_candidate", False) else "wrong"
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if f.filename in ("<prompt>", "<test>")]
        where = f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}: " if frames else ""
        error = f"{where}{type(e).__name__}: {str(e)[:300]}"
    if proxy.failure is not None:            # even if check() swallowed it
        reason, error = proxy.failure.reason, proxy.failure.detail
    return {"passed": reason is None, "reason": reason, "error": error, "calls": proxy.calls}


def _protect(job: dict[str, object]) -> None:
    """Limits and isolation of the checker process itself."""
    import resource
    import signal
    cpu = int(job["cpu_s"])
    for res, (soft, hard) in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                              (resource.RLIMIT_AS, (int(job["memory_bytes"]),) * 2),
                              (resource.RLIMIT_CORE, (0, 0))):
        cur_hard = resource.getrlimit(res)[1]
        if cur_hard != resource.RLIM_INFINITY:
            hard, soft = min(hard, cur_hard), min(soft, cur_hard)
        try:
            resource.setrlimit(res, (soft, hard))
        except (ValueError, OSError):
            pass
    signal.alarm(cpu + 2)            # ends a sleeping checker too, even if the scorer is gone
    if job["same_uid"] and sys.platform.startswith("linux"):
        # The candidate runs as our uid: without this it could ptrace us or write our memory
        # through /proc/<pid>/mem (as a private uid it cannot anyway; ctypes costs start-up).
        try:
            import ctypes
            ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)        # PR_SET_DUMPABLE 0
        except (OSError, AttributeError):
            pass
    if os.getppid() != job["parent_pid"]:
        os._exit(3)                   # the scorer is gone


def main() -> None:
    """The checker process: a JSON job on stdin (``prefix``, ``test``, ``entry_point``,
    ``timeout_s``, ``cpu_s``, ``memory_bytes``, ``parent_pid``, ``same_uid``, ``site_paths`` and
    the descriptors
    ``request_fd``, ``reply_fd``, ``verdict_fd``); the verdict (JSON) on ``verdict_fd``."""
    job = json.loads(sys.stdin.buffer.read())
    _protect(job)
    sys.path.extend(job["site_paths"])   # started with -S: third-party modules, no .pth hooks
    verdict = run_check(job, job["request_fd"], job["reply_fd"])
    os.close(job["request_fd"])                       # EOF: the candidate's server returns
    data = json.dumps(verdict).encode()
    while data:
        data = data[os.write(job["verdict_fd"], data):]
    os.close(job["verdict_fd"])


if __name__ == "__main__":
    main()
