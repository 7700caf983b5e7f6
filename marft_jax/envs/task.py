"""The task interface: where problems come from and how a finished transcript is scored.

A *task* yields :class:`Problem` items (the text every agent sees, optionally a per-agent view)
and scores a finished :class:`Transcript` into a reward in ``[0, 1]`` plus an info dict. Scoring
is a pure function of the transcript and the problem, so scoring a batch is deterministic and
can run in a worker pool (``marft_jax.envs.scoring_pool``) while the accelerator keeps working.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem.

    Attributes:
      uid: stable identifier (dataset file + row, or generator seed + index).
      text: the task text every agent sees by default.
      answer: the gold answer as given (math: a string used as-is, never re-extracted);
        code tasks keep their tests in ``meta``.
      agent_views: optional per-agent task text (Flex-MG heterogeneous observations);
        ``agent_views[i]`` replaces ``text`` for agent ``i``. ``None`` = everyone sees ``text``.
      meta: task-specific payload (tests, entry point, difficulty level, source row, ...).
        Must be picklable: it travels to scoring workers.
    """

    uid: str
    text: str
    answer: str | None = None
    agent_views: tuple[str, ...] | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def view(self, agent: int) -> str:
        """The task text agent ``agent`` sees."""
        if self.agent_views is None:
            return self.text
        return self.agent_views[agent]


@dataclasses.dataclass(frozen=True)
class Transcript:
    """A finished interaction to score.

    Attributes:
      problem: the problem that was attempted.
      outputs: decoded response of each agent at the scored step, in agent order
        (without special tokens, trailing whitespace stripped).
      answer_agent: index of the agent whose output carries the final answer.
    """

    problem: Problem
    outputs: tuple[str, ...]
    answer_agent: int

    @property
    def answer_text(self) -> str:
        return self.outputs[self.answer_agent]


@dataclasses.dataclass(frozen=True)
class Score:
    """The verdict on one transcript.

    Attributes:
      reward: in ``[0, 1]`` (math: 0 or 1; code: fraction of tests passed or all-pass).
      info: JSON-serialisable details: ``extracted`` (the answer read from the output),
        ``reason`` (why the reward is not 1, e.g. ``"no_answer"``, ``"timeout"``,
        ``"wrong"``), ``method`` (how equivalence was decided), per-test results, ...
    """

    reward: float
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.reward) <= 1.0:
            raise ValueError(f"Score.reward must be in [0, 1], got {self.reward!r}")


@runtime_checkable
class Task(Protocol):
    """What the trainer needs from an environment.

    ``kind`` is ``"math"`` or ``"code"`` (selects the profile wording and the answer format).
    ``problems(split, seed)`` yields the split's problems in a deterministic order for a seed
    (``split`` is ``"train"`` or ``"test"``). ``score(transcript)`` must be a pure,
    picklable-by-reference function of its argument (no hidden state) so that it can run in a
    process pool; it never raises on bad model output (that is reward 0 with a reason).
    """

    name: str
    kind: str

    def problems(self, split: str, seed: int = 0) -> Iterator[Problem]: ...

    def score(self, transcript: Transcript) -> Score: ...


def score_all(task: Task, transcripts: Sequence[Transcript]) -> list[Score]:
    """Score serially, in order (the reference for the pooled scorer)."""
    return [task.score(t) for t in transcripts]
