"""A math :class:`~marft_jax.envs.task.Task` over a loaded dataset, scored by ``math_grading``.

Splits are either whole files (``MathTask.from_files(train=..., test=...)``) or a reproducible
hash split of one file (``MathTask.from_split``): a problem goes to the test split when the
SHA-256 of ``f"{split_seed}:{text}"`` falls below ``test_fraction``, so the split depends only
on the problem text (not on row order) and duplicated texts never straddle the two splits.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any, Iterator, Sequence

from marft_jax.data.datasets import load_problems
from marft_jax.envs.math_grading import DEFAULT_TIMEOUT_S, grade
from marft_jax.envs.task import Problem, Score, Transcript

SPLITS = ("train", "test")


def text_hash_fraction(text: str, salt: int | str = 0) -> float:
    """A uniform-looking number in ``[0, 1)`` that depends only on ``(salt, text)``."""
    digest = hashlib.sha256(f"{salt}:{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def hash_split(
    problems: Sequence[Problem], test_fraction: float, split_seed: int = 0
) -> tuple[list[Problem], list[Problem]]:
    """Partition problems into ``(train, test)`` by text hash (see module docstring)."""
    if not 0.0 <= test_fraction <= 1.0:
        raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction!r}")
    train, test = [], []
    for p in problems:
        (test if text_hash_fraction(p.text, split_seed) < test_fraction else train).append(p)
    return train, test


def shuffled(problems: Sequence[Problem], seed: int) -> Iterator[Problem]:
    """The problems in a seed-determined order (the input order itself is never mutated)."""
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    return (problems[i] for i in order)


class MathTask:
    """Math problems with gold answers; reward 1 iff the answering agent's answer is equivalent.

    Args:
      name: task name used in logs (e.g. ``"math"``, ``"gsm8k"``).
      train, test: the problems of each split (either may be empty, not both).
      last_number_fallback: passed to :func:`~marft_jax.envs.math_grading.grade`.
      timeout_s: per-item equivalence time limit, seconds.
    """

    kind = "math"

    def __init__(
        self,
        name: str,
        train: Sequence[Problem] = (),
        test: Sequence[Problem] = (),
        *,
        last_number_fallback: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not train and not test:
            raise ValueError(f"MathTask {name!r}: both splits are empty")
        for split, items in (("train", train), ("test", test)):
            missing = [p.uid for p in items if not p.answer]
            if missing:
                raise ValueError(f"MathTask {name!r}: {split} problems without a gold answer: {missing[:5]}")
        self.name = name
        self._splits = {"train": tuple(train), "test": tuple(test)}
        self.last_number_fallback = last_number_fallback
        self.timeout_s = timeout_s

    @classmethod
    def from_files(
        cls,
        name: str,
        train: str | Path | None = None,
        test: str | Path | None = None,
        *,
        load_kwargs: dict[str, Any] | None = None,
        **task_kwargs: Any,
    ) -> "MathTask":
        """Whole-file splits: ``train`` and/or ``test`` paths, loaded with :func:`load_problems`."""
        load_kwargs = load_kwargs or {}
        return cls(
            name,
            load_problems(train, **load_kwargs) if train is not None else (),
            load_problems(test, **load_kwargs) if test is not None else (),
            **task_kwargs,
        )

    @classmethod
    def from_split(
        cls,
        name: str,
        path: str | Path,
        *,
        test_fraction: float = 0.1,
        split_seed: int = 0,
        load_kwargs: dict[str, Any] | None = None,
        **task_kwargs: Any,
    ) -> "MathTask":
        """One file, split reproducibly by text hash into train and test."""
        train, test = hash_split(load_problems(path, **(load_kwargs or {})), test_fraction, split_seed)
        return cls(name, train, test, **task_kwargs)

    def split_size(self, split: str) -> int:
        """Number of problems in ``split``."""
        return len(self._split(split))

    def _split(self, split: str) -> tuple[Problem, ...]:
        if split not in self._splits:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return self._splits[split]

    def problems(self, split: str, seed: int = 0) -> Iterator[Problem]:
        """The split's problems in a seed-determined shuffled order."""
        return shuffled(self._split(split), seed)

    def score(self, transcript: Transcript) -> Score:
        """Grade the answering agent's output against the problem's gold answer."""
        gold = transcript.problem.answer
        if not gold:
            raise ValueError(f"problem {transcript.problem.uid!r} has no gold answer")
        return grade(
            transcript.answer_text,
            gold,
            last_number_fallback=self.last_number_fallback,
            timeout_s=self.timeout_s,
        )
