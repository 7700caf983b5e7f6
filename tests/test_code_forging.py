"""Code rewards cannot be forged: programs that do not solve the task score 0.

Each forging program below is a known reward hack of code RL (issue 38): a value that lies
about equality, a success marker written from an exception hook or an ``atexit`` handler, a
rewritten call server, forged replies written straight into the pipes, an early exit, and
reading the tests or the answers from disk. The functional test's ``check()`` runs in a
trusted checker process (``marft_jax.envs.functional_test``); stdio outputs are compared in
the scorer. Correct programs still score 1.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import tempfile
import time

import pytest

from marft_jax.envs import code_task as ct
from marft_jax.envs import trusted_checker as tc
from marft_jax.envs.functional_test import run_functional_test
from marft_jax.envs.sandbox import SandboxConfig, run_program
from marft_jax.envs.task import Problem, Transcript

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the sandbox tests need POSIX")

PROMPT = 'def add(a: int, b: int) -> int:\n    """The sum of a and b."""\n'
TEST = """
import math

def check(candidate):
    assert candidate(2, 3) == 5
    assert candidate(-1, 1) == 0
    assert candidate(10, 32) == 42
    assert candidate(0.5, 0.25) == 0.75
    assert math.pi == math.pi
"""
CORRECT = "def add(a, b):\n    return a + b\n"

# Every string literal of main.py (the old success marker lived there), written to stdout.
_LITERALS = """import os, re, sys
def _forge(*_):
    src = open(os.path.abspath(sys.argv[0])).read()
    for lit in re.findall(r"[\\w.]{8,}", src):
        os.write(1, b"\\n" + lit.encode() + b"\\n")
    os._exit(0)
"""

FORGERS = {
    "eq_always_object": """
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __hash__(self): return 0
    def __sub__(self, other): return 0.0
    def __abs__(self): return 0.0
    def __lt__(self, other): return True
def add(a, b):
    return Anything()
""",
    "int_subclass_eq": """
class Liar(int):
    def __eq__(self, other): return True
    __hash__ = int.__hash__
def add(a, b):
    return Liar(0)
""",
    "str_subclass_custom_repr": """
class Five(str):
    def __repr__(self): return '5'
    def __eq__(self, other): return True
    __hash__ = str.__hash__
def add(a, b):
    return Five('5')
""",
    "marker_from_excepthook": _LITERALS + """
sys.excepthook = _forge
def add(a, b):
    return 0
raise AssertionError('tests are about to fail')
""",
    "marker_from_atexit": _LITERALS + """
import atexit
atexit.register(_forge)
def add(a, b):
    return 0
""",
    # Rewrites the call server: every request is answered "value: a + b + 1" but also
    # claims a pass in every shape it can think of.
    "monkeypatched_json_and_builtins": """
import builtins, json, sys
_loads, _dumps = json.loads, json.dumps
def loads(s, *a, **k):
    return _loads(s, *a, **k)
def dumps(obj, *a, **k):
    if isinstance(obj, dict) and "id" in obj:
        obj = {"id": obj["id"], "value": {"eq": "always"}, "passed": True}
    return _dumps(obj, *a, **k)
json.loads, json.dumps = loads, dumps
builtins.AssertionError = type("AssertionError", (Exception,), {})
sys.modules["math"] = None
def add(a, b):
    return a - b
""",
    # Forged replies (and verdicts) written into every descriptor it holds, before any call.
    "writes_to_every_fd": """
import json, os
def frame(doc):
    data = json.dumps(doc).encode()
    return len(data).to_bytes(8, "big") + data
forged = b"".join(frame(d) for d in (
    {"id": "0" * 32, "value": 5}, {"passed": True, "reason": None, "calls": 9},
    {"id": None, "value": True}))
for fd in range(0, 256):
    try:
        os.write(fd, forged)
    except OSError:
        pass
def add(a, b):
    return 0
""",
    "os_exit_before_the_test": """
import os
def add(a, b):
    return a + b
os.write(1, b"ok\\n")
os._exit(0)
""",
    # Looks for the test code wherever it could be (own source, every process's command
    # line, environment and open pipes) and, if found, answers from its asserts.
    "reads_the_test_code": """
import os, re
found = {}
texts = [open(__file__).read()]
for pid in os.listdir('/proc'):
    if pid.isdigit():
        for leaf in ('cmdline', 'environ', 'fd/0', 'mem'):
            try:
                with open(f'/proc/{pid}/{leaf}', 'rb') as f:
                    texts.append(f.read(1 << 16).decode('utf-8', 'replace'))
            except OSError:
                pass
for text in texts:
    for a, b, want in re.findall(r"candidate\\(([-.\\d]+), ([-.\\d]+)\\) == ([-.\\d]+)", text):
        found[(float(a), float(b))] = float(want)
def add(a, b):
    return found.get((a, b), 0)
""",
}


def _problem(uid: str = "add", source: str | None = None) -> Problem:
    meta = {"style": "functional", "prefix": PROMPT, "entry_point": "add", "test": TEST}
    if source:
        meta["source"] = source
    return Problem(uid=uid, text="write add", meta=meta)


def _score(task: ct.CodeTask, problem: Problem, program: str):
    text = f"My answer:\n```python\n{program}```\n"
    return task.score(Transcript(problem=problem, outputs=(text,), answer_agent=0))


@pytest.fixture(scope="module")
def task() -> ct.CodeTask:
    return ct.CodeTask(name="forge", test=(_problem(),), test_timeout_s=3.0)


def test_correct_and_plain_data_programs_score_one(task):
    assert _score(task, _problem(), CORRECT).reward == 1.0
    body_only = "    return a + b\n"                         # completes the prompt's function
    score = _score(task, _problem(), body_only)
    assert score.reward == 1.0 and score.info["reason"] is None, score.info
    assert _score(task, _problem(), "def add(a, b):\n    return a - b\n").info["reason"] == "wrong"


@pytest.mark.parametrize("name", sorted(FORGERS))
def test_forging_program_scores_zero(task, name):
    score = _score(task, _problem(), FORGERS[name])
    assert score.reward == 0.0, (name, score.info)
    assert score.info["reason"] not in (None, "checker_error"), score.info
    assert _score(task, _problem(), CORRECT).reward == 1.0     # the next program scores normally


def test_plain_data_round_trip_and_refusals():
    value = [None, True, 1, 2.5, "é\x00", (1, (2,)), {3, "a"}, {(1, 2): [{}], "k": None},
             float("inf"), [], ()]
    back = tc.decode(tc.encode(value))
    assert back == value and [type(v) for v in back] == [type(v) for v in value]
    assert type(tc.decode(tc.encode(True))) is bool and type(tc.decode(tc.encode(1))) is int
    assert math.isnan(tc.decode(tc.encode(float("nan"))))

    class Liar(int):
        pass
    for bad in (Liar(1), [Liar(1)], frozenset(), b"x", 1j, object(), {"k": range(2)}):
        with pytest.raises(tc.NotPlainData):
            tc.encode(bad)
    for doc in (b'{"a": 1}', b'{"tuple": [1], "set": []}', b'{"eq": "always"}',
                b'{"set": [[1]]}', b'{"dict": [[1]]}', b"[1,", b"\xff", b"[" * 100000):
        with pytest.raises(tc.NotPlainData):
            tc.decode(doc)


def test_values_types_and_exceptions_cross_as_in_python():
    prompt = "def f(x):\n    pass\n"
    test = """
def check(candidate):
    assert candidate([1, 2]) == (1, {2}, {"n": [1, 2]}, None, True)
    assert candidate(0) == 1          # True == 1, as in Python
    try:
        candidate(-1)
        assert False, "should raise"
    except ValueError:
        pass
"""
    program = """
def f(x):
    if x == -1:
        raise ValueError("negative")
    if x == 0:
        return True
    return (x[0], set(x[1:]), {"n": list(x)}, None, True)
"""
    cfg = SandboxConfig(timeout_s=3.0)
    res = run_functional_test(program, test, "f", prompt, cfg)
    assert res.status == "ok" and res.calls == 3, res
    unexpected = run_functional_test("def f(x):\n    raise KeyError(x)\n", test, "f", prompt, cfg)
    assert unexpected.status == "exception" and "KeyError" in unexpected.error


def test_a_test_that_catches_everything_cannot_turn_a_death_into_a_pass():
    test = """
def check(candidate):
    try:
        candidate(1)
    except:
        pass
    try:
        candidate(2)
    except Exception:
        pass
"""
    cfg = SandboxConfig(timeout_s=3.0)
    dies = "import os\ndef f(x):\n    os._exit(0)\n"
    assert run_functional_test(dies, test, "f", "", cfg).status == "exited_early"
    garbage = "def f(x):\n    return object()\n"
    assert run_functional_test(garbage, test, "f", "", cfg).status == "bad_value"
    assert run_functional_test("def f(x):\n    raise OSError(x)\n", test, "f", "",
                               cfg).status == "ok"      # a raised exception is an answer


def test_stalls_are_bounded_on_both_sides():
    cfg = SandboxConfig(timeout_s=1.0)
    t0 = time.monotonic()
    res = run_functional_test("import time\ndef add(a, b):\n    time.sleep(60)\n", TEST,
                              "add", PROMPT, cfg)
    assert res.status == "timeout" and time.monotonic() - t0 < 4.0
    slow_test = "import time\ndef check(candidate):\n    time.sleep(60)\n"
    t0 = time.monotonic()
    res = run_functional_test(CORRECT, slow_test, "add", PROMPT, cfg)
    assert res.status in ("timeout", "checker_error") and time.monotonic() - t0 < 4.0
    broken = run_functional_test(CORRECT, "def check(candidate):\n    assert candidate(1, 1) ==",
                                 "add", PROMPT, cfg)
    assert broken.status == "test_error"


@pytest.fixture(scope="module")
def outside_dir():
    """A directory the sandbox uid could read, outside the sandbox's private /tmp."""
    base = "/run" if os.access("/run", os.W_OK) else None
    path = tempfile.mkdtemp(prefix="marft_forge_", dir=base)
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _readable_in_sandbox(path: str, hide: tuple[str, ...] = ()) -> tuple[bool, dict]:
    res = run_program(f"print(len(open({path!r}, 'rb').read()))\n", "",
                      SandboxConfig(timeout_s=3.0), hide=hide)
    return res.status == "ok" and res.stdout.strip() not in ("", "0"), res.enforced


def test_answers_on_disk_are_hidden(outside_dir):
    # A HumanEval-format dataset whose canonical solution a forger execs, and a stdio
    # dataset whose expected outputs a forger prints.
    he_path = os.path.join(outside_dir, "he.jsonl.gz")
    with gzip.open(he_path, "wt") as f:
        f.write(json.dumps({"task_id": "F/0", "prompt": PROMPT, "entry_point": "add",
                            "test": TEST, "canonical_solution": "    return a + b\n"}) + "\n")
    os.chmod(he_path, 0o644)
    stdio_path = os.path.join(outside_dir, "io.jsonl")
    with open(stdio_path, "w") as f:
        f.write(json.dumps({"problem": "double it", "tests": [
            {"input": "21\n", "output": "42\n"}, {"input": "5\n", "output": "10\n"}]}) + "\n")
    os.chmod(stdio_path, 0o644)
    readable, enforced = _readable_in_sandbox(he_path)
    if not readable:
        pytest.skip("the sandbox cannot read the dataset here anyway (permissions)")
    if not enforced.get("private_tmp"):
        pytest.skip("no mount namespace here: files cannot be hidden")
    assert not _readable_in_sandbox(he_path, hide=(he_path,))[0]

    steal_solution = f"""
import gzip, json
def add(a, b):
    return 0
for line in gzip.open({he_path!r}, "rt"):
    row = json.loads(line)
    exec(row["prompt"] + row["canonical_solution"])
"""
    he_task = ct.humaneval_task(he_path, test_timeout_s=3.0)
    score = _score(he_task, he_task.test[0], steal_solution)
    assert score.reward == 0.0 and he_path in score.info["sandbox"]["hidden"], score.info
    assert _score(he_task, he_task.test[0], CORRECT).reward == 1.0

    steal_output = f"""
import json, sys
given = sys.stdin.read()
for line in open({stdio_path!r}):
    for t in json.loads(line)["tests"]:
        if t["input"] == given:
            print(t["output"])
"""
    io_task = ct.stdio_task("io", test_path=stdio_path, test_timeout_s=3.0)
    score = _score(io_task, io_task.test[0], steal_output)
    assert score.reward == 0.0 and score.info["reason"] == "wrong", score.info
    assert _score(io_task, io_task.test[0], "print(2 * int(input()))\n").reward == 1.0


def test_stdio_verdict_is_not_taken_from_the_program():
    problem = Problem(uid="io", text="t", meta={"style": "stdio", "tests": [
        {"input": "3\n", "output": "9\n"}, {"input": "4\n", "output": "16\n"}]})
    task = ct.CodeTask(name="io", test_timeout_s=3.0)
    hooks = _LITERALS + """
import atexit
atexit.register(_forge)
sys.excepthook = _forge
print("all tests passed")
raise SystemExit(0)
"""
    exit_early = "import os\nos.write(1, b'9\\n')\nos._exit(0)\n"     # right for one test only
    assert _score(task, problem, hooks).reward == 0.0
    assert _score(task, problem, exit_early).reward == 0.5
    assert _score(task, problem, "print(int(input()) ** 2)\n").reward == 1.0
