"""Running an untrusted Python program in a contained child process.

:func:`run_program` runs one program (source text) with one standard input and returns a
:class:`SandboxResult`: a status (``ok``, ``timeout``, ``memory``, ``file_limit``,
``output_limit``, ``crash``, or ``stopped`` by the caller), the captured output, the exit code, the wall time and
``enforced``, a dict saying which protections were actually active for that run.
:func:`outputs_match` compares a program's standard output with the expected one (line by
line, trailing whitespace ignored, numeric tokens equal within 1e-6).

How a run is contained
----------------------
Every run gets a fresh interpreter, its own session and process group, its own temporary
directory (removed afterwards), an environment built from scratch (``PATH``, ``LANG``,
``LC_ALL``, ``HOME`` = ``TMPDIR`` = the run directory, ``PYTHONHASHSEED=0``,
``PYTHONSAFEPATH=1``, ``PYTHONNOUSERSITE=1``, one BLAS/OpenMP thread; nothing is inherited from
the parent), a wall-clock timeout and a cap on the captured standard output and standard error
(read incrementally; the run is killed when either stream exceeds the cap). The child is
started through a small trusted bootstrap (``python -I -S -c ...``, no ``preexec_fn``, so it is
safe to call from a multi-threaded process such as a JAX trainer) that applies the limits
below and then ``execve``-s the interpreter on the program.

What is enforced where ("userns" = only where unprivileged user namespaces are allowed; the
bootstrap then maps the caller's uid into a new user namespace and gets the same network,
mount and IPC isolation as root):

============================  ===========================  =====================  ===========
protection                    Linux, parent is root        Linux, not root        other POSIX
============================  ===========================  =====================  ===========
wall timeout, kill the group  yes (SIGKILL)                yes                    yes
output cap (stdout, stderr)   yes                          yes                    yes
stripped environment          yes                          yes                    yes
own temp dir, removed after   yes                          yes                    yes
RLIMIT_CPU/AS/FSIZE/NOFILE,   yes                          yes                    best effort
CORE=0                                                                            (macOS: no AS)
unprivileged uid              yes: a uid of its own per    no (runs as the        no
                              concurrent run from a pool   caller)
                              (``uid_base`` ...), same
                              gid, no supplementary groups
RLIMIT_NPROC                  yes, per run (private uid)   counts all the         best effort
                                                           caller's processes:
                                                           set to current + N
no network                    yes: new network namespace   userns                 no
                              (even loopback is down)
private /tmp, /var/tmp,       yes: new mount namespace,    userns                 no
/dev/shm, /run/lock           size-limited noexec tmpfs
                              (``disk_bytes`` each) that
                              also holds the run directory
private IPC (SysV, mqueue)    yes: new IPC namespace       userns                 no
no_new_privs, parent-death    yes                          yes                    no
SIGKILL
kill escaped descendants      every process of the run's   the caller's           group only
(double-forked daemons)       private uid                  processes in the
                                                           group or session or
                                                           carrying the run's
                                                           token in their
                                                           environment
============================  ===========================  =====================  ===========

Non-POSIX systems (Windows) get only the timeout, output cap, environment and temp dir. With
a root parent the files of other users and of root are protected by ordinary permissions
(the program runs as an unprivileged uid that owns nothing but its run directory); without
root, the program can read and write whatever the caller can (inside a user namespace, /tmp
and friends are private tmpfs; otherwise the only disk limit is RLIMIT_FSIZE per file). The program's interpreter must be reachable by the unprivileged uid:
``sys.executable`` is used if it is, otherwise a system ``python3`` (``enforced["python"]``
names the one used). Processes are recognised by /proc, so descendants are found on Linux only.

``run_program(..., hide=paths)`` makes files or directories read as empty inside the run (an
empty root-owned file bound over a file, an empty read-only tmpfs over a directory) wherever
there is a mount namespace (root, or userns); the code task hides its dataset files so that
a program cannot look up the answers. ``pass_fds`` and ``stop_fd`` let a trusted process talk
to the program over pipes and end the run once it has its verdict: functional tests run
``check()`` outside the program (``marft_jax.envs.functional_test``), so no verdict is ever
read from the program's own output.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

_IS_POSIX = os.name == "posix"
_IS_LINUX = sys.platform.startswith("linux")

class SandboxError(RuntimeError):
    """The sandbox itself could not run (not a verdict on the program)."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits for one run.

    Attributes:
      timeout_s: wall-clock limit; the whole process group (and every escaped descendant) is
        killed when it is reached.
      cpu_s: RLIMIT_CPU in seconds; ``None`` = ``ceil(timeout_s)``.
      memory_bytes: RLIMIT_AS (address space) of every process of the run.
      file_size_bytes: RLIMIT_FSIZE, the largest file the program may write.
      disk_bytes: size of each private tmpfs (run directory, /tmp, /var/tmp, /dev/shm) when a
        mount namespace is available.
      max_processes: RLIMIT_NPROC (threads count too).
      max_open_files: RLIMIT_NOFILE.
      output_limit_bytes: cap on captured stdout and on captured stderr (each).
      isolate_network: put the program in an empty network namespace when possible.
      drop_privileges: when the parent is root, run as an unprivileged uid of its own; if that
        is impossible, runs raise ``SandboxError`` rather than run as root (``False`` = accept
        running as root, with every other protection).
      python: interpreter for the program; ``None`` = ``sys.executable`` if the sandbox uid can
        run it, else a system ``python3``.
      uid_base, uid_pool: the sandbox uids are ``uid_base ... uid_base + uid_pool - 1``, one per
        concurrent run (they need no /etc/passwd entry).
    """

    timeout_s: float = 5.0
    cpu_s: float | None = None
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    disk_bytes: int = 64 << 20
    max_processes: int = 32
    max_open_files: int = 64
    output_limit_bytes: int = 1 << 20
    isolate_network: bool = True
    drop_privileges: bool = True
    python: str | None = None
    uid_base: int = 2_000_000_000
    uid_pool: int = 256

    def __post_init__(self) -> None:
        for field in ("timeout_s", "memory_bytes", "file_size_bytes", "disk_bytes",
                      "max_processes", "max_open_files", "output_limit_bytes", "uid_pool"):
            if not getattr(self, field) > 0:
                raise ValueError(f"sandbox.{field} must be > 0, got {getattr(self, field)!r}")
        if self.cpu_s is not None and not self.cpu_s > 0:
            raise ValueError(f"sandbox.cpu_s must be > 0 or None, got {self.cpu_s!r}")

    def with_timeout(self, timeout_s: float) -> "SandboxConfig":
        return dataclasses.replace(self, timeout_s=timeout_s)


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run.

    Attributes:
      status: ``ok`` (exit 0), ``timeout`` (wall or CPU limit), ``memory`` (MemoryError or
        address-space limit), ``file_limit`` (RLIMIT_FSIZE), ``output_limit`` (captured output
        over the cap), ``crash`` (any other non-zero exit or signal), ``stopped`` (killed
        because the caller's ``stop_fd`` became readable).
      stdout, stderr: captured text (utf-8, undecodable bytes replaced), at most the cap.
      returncode: exit code, negative for a signal; ``None`` if unknown.
      elapsed_s: wall time from start to exit (or kill).
      enforced: which protections were active (see the module docstring).
    """

    status: str
    stdout: str
    stderr: str
    returncode: int | None
    elapsed_s: float
    enforced: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# --------------------------------------------------------------------------- comparison

_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def _tokens_equal(got: str, want: str, tol: float) -> bool:
    if got == want:
        return True
    if _NUMBER.fullmatch(got) and _NUMBER.fullmatch(want):
        a, b = float(got), float(want)
        return math.isclose(a, b, rel_tol=tol, abs_tol=tol)
    return False


def outputs_match(got: str, expected: str, tol: float = 1e-6) -> bool:
    """Line-by-line comparison of a program's output with the expected output.

    Trailing whitespace of every line and trailing blank lines are ignored; lines are compared
    token by token (whitespace-separated) and two numeric tokens match when they are within
    ``tol`` absolutely or relatively (``math.isclose``). Other tokens must be equal.
    """

    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out

    got_lines, want_lines = lines(got), lines(expected)
    if len(got_lines) != len(want_lines):
        return False
    for g, w in zip(got_lines, want_lines):
        gt, wt = g.split(), w.split()
        if len(gt) != len(wt) or not all(_tokens_equal(a, b, tol) for a, b in zip(gt, wt)):
            return False
    return True


# --------------------------------------------------------------------------- bootstrap

# Runs as the first program in the child (trusted, still with the parent's privileges),
# applies the protections, reports what worked on a pipe, then execs the interpreter on the
# untrusted program. Argument: a JSON config (see _bootstrap_config).
_BOOTSTRAP = r"""
import json, os, sys
cfg = json.loads(sys.argv[1])
rep = {}
def report_and_close():
    os.write(cfg["report_fd"], json.dumps(rep).encode())
    os.close(cfg["report_fd"])
libc = None
if cfg["linux"]:
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                               ctypes.c_ulong, ctypes.c_char_p]
    except Exception:
        libc = None
def unshare(flag):
    try:
        return libc is not None and libc.unshare(flag) == 0
    except Exception:
        return False
files = {}
for name in cfg["files"]:
    with open(name, "rb") as f:
        files[name] = f.read()
workdir = os.getcwd()
NEWNS, NEWIPC, NEWNET, NEWUSER = 0x00020000, 0x08000000, 0x40000000, 0x10000000
mntns = False
rep["netns"] = rep["ipcns"] = rep["userns"] = False
if cfg["root"]:
    rep["netns"] = bool(cfg["netns"]) and unshare(NEWNET)
    rep["ipcns"] = unshare(NEWIPC)
    mntns = unshare(NEWNS)
elif cfg["userns"]:
    euid, egid = os.geteuid(), os.getegid()
    if unshare(NEWUSER | NEWNS | NEWIPC | (NEWNET if cfg["netns"] else 0)):
        try:
            for path, text in (("/proc/self/setgroups", "deny"),
                               ("/proc/self/uid_map", "%d %d 1" % (euid, euid)),
                               ("/proc/self/gid_map", "%d %d 1" % (egid, egid))):
                with open(path, "w") as f:
                    f.write(text)
        except OSError as e:
            rep["error"] = "user namespace set up failed: %s" % e
            report_and_close()
            os._exit(111)
        rep["userns"] = rep["ipcns"] = mntns = True
        rep["netns"] = bool(cfg["netns"])
mounted = []
private_root = False
if mntns:
    # MS_REC | MS_PRIVATE on /: nothing mounted below can propagate to the host.
    private_root = libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) == 0
    if private_root:
        for path in cfg["tmpfs"]:
            if not os.path.isdir(path) or os.path.islink(path):
                continue
            opts = "size=%d,nr_inodes=4096,mode=1777" % cfg["disk_bytes"]
            # MS_NOSUID | MS_NODEV | MS_NOEXEC
            if libc.mount(b"tmpfs", path.encode(), b"tmpfs", 2 | 4 | 8, opts.encode()) == 0:
                mounted.append(path)
rep["private_tmp"] = mounted
uid, gid = cfg["uid"], cfg["gid"]
if "/tmp" in mounted:
    workdir = "/tmp/run"
    os.mkdir(workdir, 0o700)
    for name, data in files.items():
        path = os.path.join(workdir, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, 0o644)
    if uid is not None:
        os.chown(workdir, uid, gid)
    os.chdir(workdir)
rep["workdir"] = workdir
hidden = []
if private_root and cfg["hide"]:
    # Hidden files read as empty (an empty root-owned file bound over them), hidden
    # directories as an empty read-only tmpfs; only in this run's mount namespace.
    empty = b"/dev/null"
    if "/tmp" in mounted:
        empty = b"/tmp/.marft_hidden"
        with open(empty, "wb"):
            pass
        os.chmod(empty, 0o444)
    for path in cfg["hide"]:
        if os.path.isdir(path):
            ok = libc.mount(b"tmpfs", path.encode(), b"tmpfs", 1 | 2 | 4 | 8,
                            b"size=4k,nr_inodes=8,mode=555") == 0
        elif os.path.exists(path):
            ok = libc.mount(empty, path.encode(), None, 4096, None) == 0   # MS_BIND
        else:
            ok = False
        if ok:
            hidden.append(path)
rep["hidden"] = hidden
try:
    import resource
    for name, (soft, hard) in cfg["rlimits"].items():
        res = getattr(resource, name, None)
        if res is None:
            rep[name] = None
            continue
        cur_soft, cur_hard = resource.getrlimit(res)
        if cur_hard != resource.RLIM_INFINITY:
            hard = min(hard, cur_hard)
            soft = min(soft, hard)
        try:
            resource.setrlimit(res, (soft, hard))
            rep[name] = soft
        except (ValueError, OSError):
            rep[name] = None
except ImportError:
    pass
rep["uid"] = None
if uid is not None:
    try:
        os.setgroups([])
        if hasattr(os, "setresuid"):
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        else:
            os.setgid(gid)
            os.setuid(uid)
        rep["uid"] = uid
    except OSError as e:
        rep["error"] = "cannot drop privileges to uid %d: %s" % (uid, e)
        report_and_close()
        os._exit(111)
def prctl(option, arg):
    try:
        return libc is not None and libc.prctl(option, arg, 0, 0, 0) == 0
    except Exception:
        return False
rep["no_new_privs"] = prctl(38, 1)          # PR_SET_NO_NEW_PRIVS
rep["parent_death_kill"] = prctl(1, 9)     # PR_SET_PDEATHSIG, SIGKILL
env = dict(os.environ)
env["HOME"] = env["TMPDIR"] = workdir
report_and_close()
try:
    os.execve(cfg["python"], [cfg["python"]] + cfg["flags"] + [cfg["main"]], env)
except OSError as e:
    sys.stderr.write("sandbox: cannot exec %s: %s\n" % (cfg["python"], e))
    os._exit(127)
"""

_TMPFS_PATHS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_RUNTIME_CACHE: dict[tuple, "_Runtime"] = {}
_RUNTIME_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class _Runtime:
    python: str
    uid_pool: tuple[int, ...]   # empty = run as the caller
    userns: bool                # not root: try a user namespace (net, mount, IPC isolation)
    notes: tuple[str, ...]


def _is_root() -> bool:
    return _IS_POSIX and os.geteuid() == 0


def _uids_mappable(lo: int, hi: int) -> bool:
    """Whether uids lo..hi-1 exist in this user namespace (Linux uid_map)."""
    try:
        with open("/proc/self/uid_map") as f:
            for line in f:
                inside, _, count = (int(x) for x in line.split())
                if inside <= lo and hi <= inside + count:
                    return True
        return False
    except OSError:
        return not _IS_LINUX


def _runtime(config: SandboxConfig) -> _Runtime:
    """Which interpreter and uid pool to use; probed once per process and configuration."""
    key = (config.python, config.drop_privileges, config.uid_base, config.uid_pool)
    with _RUNTIME_LOCK:
        cached = _RUNTIME_CACHE.get(key)
    if cached is not None:
        return cached
    notes: list[str] = []
    pool: tuple[int, ...] = ()
    if _is_root() and config.drop_privileges:
        lo, hi = config.uid_base, config.uid_base + config.uid_pool
        if _uids_mappable(lo, hi):
            pool = tuple(range(lo, hi))
        else:
            raise SandboxError(f"refusing to run untrusted code as root: sandbox uids "
                               f"{lo}..{hi - 1} are not mapped in this user namespace (set "
                               "sandbox.uid_base, or drop_privileges=False to accept root)")
    candidates = [config.python] if config.python else [
        sys.executable, getattr(sys, "_base_executable", None),
        shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")]
    candidates = list(dict.fromkeys(c for c in candidates if c))
    probe_cfg = dataclasses.replace(config, timeout_s=10.0, cpu_s=10.0)

    def works(rt: _Runtime) -> str | None:
        """None if a trivial program runs under ``rt``, else why not."""
        try:
            res = _run(rt, "print('ok')\n", "", probe_cfg)
        except SandboxError as e:
            return str(e)
        if res.status == "ok" and res.stdout.strip() == "ok":
            return None
        return f"{res.status}: {res.stderr.strip()[-200:]}"

    chosen = None
    if pool:
        for cand in candidates:
            why = works(_Runtime(cand, pool, False, ()))
            if why is None:
                chosen = cand
                break
            notes.append(f"{cand} cannot run as the sandbox uid ({why[-120:]})")
        if chosen is None:
            raise SandboxError("refusing to run untrusted code as root: no interpreter is "
                               f"usable by the sandbox uid ({'; '.join(notes)}); set "
                               "sandbox.python, or drop_privileges=False to accept root")
    if chosen is None:
        chosen = candidates[0] if candidates else sys.executable
    userns = False
    if _IS_LINUX and not _is_root():
        why = works(_Runtime(chosen, (), True, ()))
        userns = why is None
        if not userns:
            notes.append(f"no user namespace ({why}): network and /tmp are shared")
    rt = _Runtime(python=chosen, uid_pool=pool, userns=userns, notes=tuple(notes))
    with _RUNTIME_LOCK:
        _RUNTIME_CACHE[key] = rt
    return rt


# --------------------------------------------------------------------------- uid slots


class _UidSlot:
    """An exclusive lease on one sandbox uid (an flock'ed file), so concurrent runs in any
    process of this machine never share a uid and killing "every process of the uid" is safe."""

    def __init__(self, pool: tuple[int, ...], wait_s: float = 30.0):
        lockdir = os.path.join(tempfile.gettempdir(), f"marft_jax_sandbox_{os.geteuid()}")
        os.makedirs(lockdir, mode=0o700, exist_ok=True)
        st = os.lstat(lockdir)
        if st.st_uid != os.geteuid() or (st.st_mode & 0o077):
            raise SandboxError(f"sandbox lock directory {lockdir} is not private to uid "
                               f"{os.geteuid()}; remove it")
        import fcntl
        deadline = time.monotonic() + wait_s
        order = list(pool)
        random.shuffle(order)
        while True:
            for uid in order:
                fh = open(os.path.join(lockdir, f"{uid}.lock"), "a")
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    fh.close()
                    continue
                self.uid, self._fh = uid, fh
                return
            if time.monotonic() > deadline:
                raise SandboxError(f"all {len(pool)} sandbox uids busy for {wait_s} s")
            time.sleep(0.05)

    def release(self) -> None:
        self._fh.close()


# --------------------------------------------------------------------------- process cleanup


def _proc_entries():
    """(pid, real uid, state, pgrp, session) of every process, from /proc."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            fields = stat[stat.rindex(b")") + 2:].split()
            state, pgrp, session = fields[0].decode(), int(fields[2]), int(fields[3])
            uid = os.stat(f"/proc/{pid}").st_uid
        except (OSError, ValueError, IndexError):
            continue
        yield pid, uid, state, pgrp, session


def _has_token(pid: int, token: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return token in f.read()
    except OSError:
        return False


def _kill_leftovers(pgid: int | None, uid: int | None, token: bytes) -> int:
    """SIGKILL the group and every escaped descendant: with a private ``uid`` every process of
    that uid, otherwise the caller's processes in the group or session ``pgid`` or carrying
    ``token`` in their environment. Returns how many were found beyond the group."""
    if pgid is not None and pgid > 1:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if not _IS_LINUX:
        return 0
    me, found = os.getpid(), set()
    for _ in range(200):
        victims = []
        for pid, puid, state, pgrp, session in _proc_entries():
            if pid == me or state in ("Z", "X"):
                continue
            if uid is not None:
                hit = puid == uid
            else:
                hit = puid == os.geteuid() and (
                    pgrp == pgid or session == pgid or _has_token(pid, token))
            if hit:
                victims.append(pid)
        if not victims:
            return len(found)
        found.update(victims)
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
    return len(found)


def _remove_tree(path: str) -> None:
    def onerror(func, p, exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass
    shutil.rmtree(path, onerror=onerror)


# --------------------------------------------------------------------------- running


def _classify(returncode: int | None, stderr: str, timed_out: bool, over_cap: bool) -> str:
    if over_cap:
        return "output_limit"
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    tail = stderr[-2000:]
    if _IS_POSIX and returncode == -signal.SIGXCPU:
        return "timeout"
    if "MemoryError" in tail or "Cannot allocate memory" in tail:
        return "memory"
    if (_IS_POSIX and returncode == -signal.SIGXFSZ) or "File too large" in tail:
        return "file_limit"
    return "crash"


def _clean_env(token: str, workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
        "HOME": workdir, "TMPDIR": workdir, "PYTHONHASHSEED": "0", "PYTHONSAFEPATH": "1",
        "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        "MARFT_SANDBOX_TOKEN": token,
    }


def _rlimits(config: SandboxConfig, uid: int | None) -> dict[str, tuple[int, int]]:
    cpu = math.ceil(config.cpu_s if config.cpu_s is not None else config.timeout_s)
    limits = {
        "RLIMIT_CPU": (cpu, cpu + 1),
        "RLIMIT_AS": (config.memory_bytes, config.memory_bytes),
        "RLIMIT_FSIZE": (config.file_size_bytes, config.file_size_bytes),
        "RLIMIT_NOFILE": (config.max_open_files, config.max_open_files),
        "RLIMIT_CORE": (0, 0),
    }
    nproc = config.max_processes
    if uid is None and _IS_LINUX:
        # Without a private uid, NPROC counts all of the caller's processes.
        nproc += sum(1 for e in _proc_entries() if e[1] == os.geteuid())
    limits["RLIMIT_NPROC"] = (nproc, nproc)
    return limits


@dataclasses.dataclass
class _Channel:
    """What a caller shares with one run: ``pass_fds`` stay open in the program under the same
    numbers, the run ends early (status ``stopped``) once ``stop_fd`` is readable or at EOF,
    and the paths in ``hide`` read as empty inside the run."""

    pass_fds: tuple[int, ...] = ()
    stop_fd: int | None = None
    hide: tuple[str, ...] = ()
    fds_closed: bool = False

    def close_fds(self) -> None:
        """Close the caller's copies of ``pass_fds`` once (a second close could hit a reused
        descriptor number)."""
        if not self.fds_closed:
            self.fds_closed = True
            for fd in self.pass_fds:
                try:
                    os.close(fd)
                except OSError:
                    pass


def _run(rt: _Runtime, program: str, stdin: str, config: SandboxConfig,
         channel: _Channel | None = None) -> SandboxResult:
    channel = channel or _Channel()
    token = uuid.uuid4().hex
    slot = _UidSlot(rt.uid_pool) if rt.uid_pool else None
    uid = slot.uid if slot else None
    root = tempfile.mkdtemp(prefix="marft_sbx_")
    try:
        os.chmod(root, 0o711)
        workdir = os.path.join(root, "run")
        os.mkdir(workdir, 0o700)
        main = "main.py"
        with open(os.path.join(workdir, main), "w", encoding="utf-8") as f:
            f.write(program)
        os.chmod(os.path.join(workdir, main), 0o644)
        stdin_path = os.path.join(root, "stdin")
        with open(stdin_path, "w", encoding="utf-8") as f:
            f.write(stdin)
        os.chmod(stdin_path, 0o600)
        if uid is not None:
            os.chown(workdir, uid, uid)
            _kill_leftovers(None, uid, token.encode())  # from a parent that died mid-run
        return _spawn_and_wait(rt, uid, main, workdir, stdin_path, token, config, channel)
    finally:
        if slot is not None:
            slot.release()
        _remove_tree(root)


def _spawn_and_wait(rt: _Runtime, uid: int | None, main: str, workdir: str, stdin_path: str,
                    token: str, config: SandboxConfig, channel: _Channel) -> SandboxResult:
    python = rt.python
    env = _clean_env(token, workdir)
    enforced: dict[str, Any] = {
        "wall_timeout_s": config.timeout_s, "output_limit_bytes": config.output_limit_bytes,
        "env_stripped": True, "own_session": _IS_POSIX, "python": python,
        "kill_scope": ("uid" if uid is not None else
                       "group+session+token" if _IS_LINUX else "group"),
        "notes": list(rt.notes),
    }
    report_r = report_w = None
    if _IS_POSIX:
        report_r, report_w = os.pipe()
        os.set_inheritable(report_w, True)
        cfg = {
            "report_fd": report_w, "linux": _IS_LINUX, "files": [main], "main": main,
            "python": python, "flags": ["-s"], "uid": uid, "gid": uid,
            "netns": config.isolate_network, "root": _is_root(), "userns": rt.userns,
            "tmpfs": list(_TMPFS_PATHS), "disk_bytes": config.disk_bytes,
            "rlimits": _rlimits(config, uid), "hide": list(channel.hide),
        }
        argv = [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, json.dumps(cfg)]
        kwargs: dict[str, Any] = {"start_new_session": True,
                                  "pass_fds": (report_w, *channel.pass_fds)}
    else:
        argv = [python, "-s", main]
        kwargs = {}
    start = time.monotonic()
    with open(stdin_path, "rb") as stdin_file:
        try:
            proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=workdir, env=env,
                                    close_fds=True, **kwargs)
        except OSError as e:
            raise SandboxError(f"cannot start the sandbox interpreter {argv[0]}: {e}") from e
        finally:
            if report_w is not None:
                os.close(report_w)
            channel.close_fds()      # the program holds them now: EOF reaches the peer with it
    out, err, timed_out, over_cap, stopped = _collect(proc, start, config, channel.stop_fd)
    elapsed = time.monotonic() - start
    if _IS_POSIX:
        enforced["leftover_processes_killed"] = _kill_leftovers(
            proc.pid, uid, token.encode())
    else:
        proc.kill()
    returncode = proc.wait()
    if report_r is not None:
        chunks = []
        os.set_blocking(report_r, False)
        try:
            while chunk := os.read(report_r, 65536):
                chunks.append(chunk)
        except BlockingIOError:
            pass
        os.close(report_r)
        try:
            report = json.loads(b"".join(chunks) or b"{}")
        except ValueError:
            report = {}
        if "error" in report:
            raise SandboxError(report["error"])
        enforced.update(report)
    stderr = err.decode("utf-8", "replace")
    status = "stopped" if stopped else _classify(returncode, stderr, timed_out, over_cap)
    return SandboxResult(status=status, stdout=out.decode("utf-8", "replace"), stderr=stderr,
                         returncode=returncode, elapsed_s=elapsed, enforced=enforced)


def _collect(proc: subprocess.Popen, start: float, config: SandboxConfig,
             stop_fd: int | None = None):
    """Read stdout/stderr until both close, the process exits (then a short grace for
    daemons holding the pipes), the deadline passes, a stream exceeds the cap, or ``stop_fd``
    (not read here) is readable while the process still runs."""
    deadline = start + config.timeout_s
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for stream in bufs:
        os.set_blocking(stream.fileno(), False)
        sel.register(stream, selectors.EVENT_READ)
    if stop_fd is not None:
        sel.register(stop_fd, selectors.EVENT_READ)
    timed_out = over_cap = stopped = False
    exited_at = None

    def fds_of(selector):
        return {key.fd for key in selector.get_map().values()}
    try:
        while (any(stream in sel.get_map() for stream in bufs)
               or (stop_fd in fds_of(sel) and proc.poll() is None)):
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.2:
                break
            for key, _ in sel.select(timeout=min(0.05, deadline - now)):
                if key.fd == stop_fd:
                    sel.unregister(stop_fd)
                    # A program ending by itself is not "stopped": its descriptors close
                    # (which may be what made stop_fd readable) just before it can be reaped.
                    try:
                        proc.wait(timeout=0.25)
                    except subprocess.TimeoutExpired:
                        stopped = True
                    continue
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.fileobj]
                buf += chunk
                if len(buf) > config.output_limit_bytes:
                    del buf[config.output_limit_bytes:]
                    over_cap = True
            if over_cap or stopped:
                break
        if not timed_out and not stopped and not over_cap and exited_at is None:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
    return (bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), timed_out, over_cap,
            stopped)


def run_program(program: str, stdin: str = "", config: SandboxConfig | None = None, *,
                pass_fds: tuple[int, ...] = (), stop_fd: int | None = None,
                hide: tuple[str, ...] = ()) -> SandboxResult:
    """Run ``program`` (Python source) with ``stdin`` under ``config``; never raises for
    anything the program does (``SandboxError`` only when the sandbox itself cannot start).

    Args:
      pass_fds: the caller's file descriptors the program gets under the same numbers (POSIX;
        e.g. the ends of pipes to a trusted checker). They belong to the run: this function
        closes the caller's copies, whatever happens.
      stop_fd: a descriptor the caller keeps; once it is readable (or at EOF) the run is
        killed and its status is ``stopped``. It is never read here.
      hide: absolute paths that read as empty inside the run (files: an empty file bound over
        them; directories: an empty read-only tmpfs). Needs a mount namespace (root, or user
        namespaces); ``enforced["hidden"]`` lists the paths actually hidden.
    """
    config = config or SandboxConfig()
    channel = _Channel(tuple(pass_fds), stop_fd, tuple(os.path.realpath(p) for p in hide))
    try:
        return _run(_runtime(config), program, stdin, config, channel)
    finally:
        channel.close_fds()
