"""Pooled scoring (marft_jax.envs.scoring_pool) against the serial reference ``score_all``."""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import pytest

from marft_jax.envs.arithmetic import ArithmeticTask
from marft_jax.envs.scoring_pool import ScoringPool
from marft_jax.envs.task import Problem, Score, Transcript, score_all


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
    with ScoringPool(SlowTask(), workers=2, chunk_size=1) as pool:
        start = time.monotonic()
        handle = pool.submit(transcripts)
        assert time.monotonic() - start < 0.25  # did not wait for the 0.3 s scores
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
