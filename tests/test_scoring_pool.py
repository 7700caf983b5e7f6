"""Pooled scoring (marft_jax.envs.scoring_pool) against the serial reference ``score_all``."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from marft_jax.envs.arithmetic import ArithmeticTask
from marft_jax.envs.scoring_pool import ScoringPool
from marft_jax.envs.task import Problem, Score, Transcript, score_all

ROOT = Path(__file__).resolve().parents[1]


def _transcripts(task: ArithmeticTask, n: int) -> list[Transcript]:
    """A mix of correct, wrong, symbolic (math-verify path) and answer-less outputs."""
    out = []
    for i, p in enumerate(list(task.problems("test"))[:n]):
        gold = int(p.answer)
        answer = [
            f"So the total is \\boxed{{{gold}}}.",
            f"The answer is {gold + 1}.",
            f"\\boxed{{\\frac{{{2 * gold}}}{{2}}}}",
            "I am not sure.",
            f"We get {gold} in the end",
        ][i % 5]
        out.append(Transcript(problem=p, outputs=("plan: add things", answer), answer_agent=1))
    return out


@pytest.fixture(scope="module")
def task() -> ArithmeticTask:
    return ArithmeticTask(level=2, n_train=10, n_test=40, data_seed=3)


def test_serial_pool_equals_reference(task):
    transcripts = _transcripts(task, 40)
    pool = ScoringPool(task, workers=0)
    handle = pool.submit(transcripts)
    assert handle.done()
    assert handle.result() == score_all(task, transcripts)


def test_process_pool_equals_serial_and_keeps_order(task):
    transcripts = _transcripts(task, 40)
    expected = score_all(task, transcripts)
    assert [s.reward for s in expected][:5] == [1.0, 0.0, 1.0, 0.0, 1.0]  # hand-derived
    with ScoringPool(task, workers=2, chunk_size=3) as pool:
        got = pool.score(transcripts)
        again = pool.submit(list(reversed(transcripts))).result(timeout=120)
    assert got == expected
    assert again == list(reversed(expected))


@dataclasses.dataclass(frozen=True)
class SlowTask:
    """Scores ``len(answer) % 2`` after a short sleep; raises on the marker "boom"."""

    delay_s: float = 0.3
    name: str = "slow"
    kind: str = "math"

    def problems(self, split: str, seed: int = 0) -> Iterator[Problem]:
        return iter(())

    def score(self, transcript: Transcript) -> Score:
        if transcript.answer_text == "boom":
            raise RuntimeError("boom in worker")
        time.sleep(self.delay_s)
        return Score(float(len(transcript.answer_text) % 2), {"n": len(transcript.answer_text)})


def _plain(texts: list[str]) -> list[Transcript]:
    return [Transcript(Problem(uid=f"p{i}", text="q"), (t,), 0) for i, t in enumerate(texts)]


def test_submit_is_asynchronous_and_result_can_time_out():
    transcripts = _plain(["a", "bb", "ccc", "dddd"])
    with ScoringPool(SlowTask(delay_s=1.0), workers=2, chunk_size=1) as pool:
        start = time.monotonic()
        handle = pool.submit(transcripts)
        assert time.monotonic() - start < 0.9  # did not wait for the 1 s scores (slack for a loaded box)
        assert not handle.done()
        with pytest.raises(TimeoutError):
            handle.result(timeout=0.01)
        scores = handle.result(timeout=120)
    assert [s.reward for s in scores] == [1.0, 0.0, 1.0, 0.0]
    assert [s.info["n"] for s in scores] == [1, 2, 3, 4]


def test_worker_exception_propagates_and_closed_pool_refuses_work():
    pool = ScoringPool(SlowTask(delay_s=0.0), workers=1)
    with pytest.raises(RuntimeError, match="boom in worker"):
        pool.score(_plain(["ok", "boom"]))
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(_plain(["x"]))


def test_invalid_arguments():
    with pytest.raises(ValueError, match="workers"):
        ScoringPool(SlowTask(), workers=-1)
    with pytest.raises(ValueError, match="chunk_size"):
        ScoringPool(SlowTask(), workers=0, chunk_size=0)


_SIGNAL_SCRIPT = """
import json, signal, sys, time
from marft_jax.envs.scoring_pool import ScoringPool
from tests.test_scoring_pool import SlowTask, _plain

if __name__ == "__main__":
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):      # as the trainer does: note the signal, finish
        signal.signal(sig, lambda s, f: stop.append(s))
    with ScoringPool(SlowTask(delay_s=1.0), workers=2, chunk_size=1) as pool:
        pool.score(_plain(["a", "b"]))                # the workers are up
        handle = pool.submit(_plain(["a", "bb", "ccc", "dddd"]))
        print(json.dumps({"workers": sorted(pool._executor._processes)}), flush=True)
        if sys.argv[1] == "orphan":
            time.sleep(600)
        while not stop:
            time.sleep(0.05)
        scores = handle.result(timeout=120)
    print(json.dumps({"signal": stop[0], "rewards": [s.reward for s in scores]}), flush=True)
"""


def _start_signal_script(mode: str) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", _SIGNAL_SCRIPT, mode], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    line = proc.stdout.readline()
    assert line, proc.communicate(timeout=60)[1][-3000:]
    return proc, json.loads(line)["workers"]


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_callers_process_group_leaves_the_workers_to_finish(sig):
    """Ctrl-C in a terminal (or ``kill -- -PGID``) signals the whole group; the caller notes it
    and still gets the batch it had submitted (before, the workers died: BrokenProcessPool)."""
    proc, workers = _start_signal_script("signal")
    assert len(workers) >= 1
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out.splitlines()[-1]) == {"signal": int(sig), "rewards": [1.0, 0.0, 1.0, 0.0]}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state         # a zombie has exited (its reaper may be slow)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_workers_exit_when_the_caller_is_killed():
    proc, workers = _start_signal_script("orphan")
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 20
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, workers)), workers
