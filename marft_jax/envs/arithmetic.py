"""The embedded default task: seeded multi-step arithmetic word problems with integer answers.

A problem is a short story about one person and one kind of item: a starting count, then
``level`` operations (buy/find more, give away, multiply, share equally), then "How many ...?".
Every intermediate count is a positive integer (no negatives, no division remainders).
``meta["expression"]`` holds the left-to-right expression, e.g. ``"((3 + 4) * 2)"``, so tests
can check the answer independently.

Level ``L`` (1..5) uses ``L`` operations; operand sizes grow with the level (see
:data:`LEVELS`). Level 1 reads like "Tom has 3 apples. Tom buys 4 more apples. How many apples
does Tom have now?".

Splits: candidates are drawn from one seeded stream; a text goes to the test split when its
hash falls below ``test_fraction`` (:func:`marft_jax.envs.math_task.text_hash_fraction`), so
train and test never share a problem text, and each split is fixed by ``data_seed``.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Iterator

from marft_jax.envs.math_grading import DEFAULT_TIMEOUT_S, grade
from marft_jax.envs.math_task import shuffled, text_hash_fraction
from marft_jax.envs.task import Problem, Score, Transcript


@dataclasses.dataclass(frozen=True)
class Level:
    """Difficulty: ``n_ops`` operations; start and +/- operands in ``[1, max_operand]``;
    multipliers in ``[2, max_factor]``."""

    n_ops: int
    max_operand: int
    max_factor: int


LEVELS: dict[int, Level] = {
    1: Level(n_ops=1, max_operand=10, max_factor=3),
    2: Level(n_ops=2, max_operand=20, max_factor=4),
    3: Level(n_ops=3, max_operand=50, max_factor=5),
    4: Level(n_ops=4, max_operand=100, max_factor=6),
    5: Level(n_ops=5, max_operand=200, max_factor=9),
}

NAMES = ("Tom", "Ana", "Li", "Sara", "Omar", "Maya", "Ben", "Priya", "Kofi", "Elena", "Yuki", "Noah")
ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "shells", "cards", "stamps")

# "{items_k}" is the noun agreeing with k ("1 apple", "2 apples"); "{items}" is the plural.
_ADD = (
    "{n} buys {k} more {items_k}.",
    "{n} finds {k} more {items_k}.",
    "A friend gives {n} {k} more {items_k}.",
)
_SUB = ("{n} gives away {k} {items_k}.", "{n} loses {k} {items_k}.", "{n} sells {k} {items_k}.")
_MUL = (
    "Then {n} ends up with {k} times as many {items} as before.",
    "The number of {items} {n} has becomes {k} times as large.",
)
_DIV = ("{n} splits the {items} into {k} equal groups and keeps just one group.",)


def _noun(count: int, items: str) -> str:
    """``items`` (a plural ending in "s") agreeing with ``count``."""
    return items if count != 1 else items[:-1]


def _step(rng: random.Random, value: int, level: Level) -> tuple[str, int, str]:
    """One operation on the current count: ``(op_symbol, operand, template)``; result > 0."""
    ops = ["+", "*"]
    if value > 1:
        ops.append("-")
    divisors = [d for d in range(2, min(value, level.max_factor * 2) + 1) if value % d == 0 and d < value]
    if divisors:
        ops.append("/")
    op = rng.choice(ops)
    if op == "+":
        return op, rng.randint(1, level.max_operand), rng.choice(_ADD)
    if op == "-":
        return op, rng.randint(1, min(value - 1, level.max_operand)), rng.choice(_SUB)
    if op == "*":
        return op, rng.randint(2, level.max_factor), rng.choice(_MUL)
    return op, rng.choice(divisors), rng.choice(_DIV)


def generate_problem(level: int, rng: random.Random) -> tuple[str, int, str]:
    """Draw one word problem.

    Returns:
      ``(text, answer, expression)``; ``expression`` evaluates (left to right, parenthesized)
      to ``answer``, and every partial result is a positive integer.
    """
    if level not in LEVELS:
        raise ValueError(f"arithmetic level must be one of {sorted(LEVELS)}, got {level!r}")
    spec = LEVELS[level]
    name, items = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(1, spec.max_operand)
    sentences = [f"{name} has {value} {_noun(value, items)}."]
    expression = str(value)
    for _ in range(spec.n_ops):
        op, k, template = _step(rng, value, spec)
        sentences.append(template.format(n=name, k=k, items=items, items_k=_noun(k, items)))
        expression = f"({expression} {op} {k})"
        value = {"+": value + k, "-": value - k, "*": value * k, "/": value // k}[op]
    sentences.append(f"How many {items} does {name} have now?")
    return " ".join(sentences), value, expression


class ArithmeticTask:
    """Seeded arithmetic word problems; reward 1 iff the answer equals the integer result.

    Args:
      level: difficulty 1..5 (number of operations).
      n_train, n_test: split sizes.
      data_seed: fixes the contents of both splits.
      test_fraction: share of the hash space assigned to the test split.
      max_draws: give up (ValueError) after this many candidate draws; default
        ``50 * (n_train + n_test) + 1000``.
      last_number_fallback, timeout_s: passed to :func:`~marft_jax.envs.math_grading.grade`.
    """

    kind = "math"

    def __init__(
        self,
        level: int = 1,
        *,
        n_train: int = 2000,
        n_test: int = 200,
        data_seed: int = 0,
        test_fraction: float = 0.2,
        max_draws: int | None = None,
        last_number_fallback: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if level not in LEVELS:
            raise ValueError(f"arithmetic level must be one of {sorted(LEVELS)}, got {level!r}")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
        self.name = f"arithmetic-l{level}"
        self.level = level
        self.last_number_fallback = last_number_fallback
        self.timeout_s = timeout_s
        max_draws = max_draws if max_draws is not None else 50 * (n_train + n_test) + 1000
        self._splits = self._build(n_train, n_test, data_seed, test_fraction, max_draws)

    def _build(
        self, n_train: int, n_test: int, data_seed: int, test_fraction: float, max_draws: int
    ) -> dict[str, tuple[Problem, ...]]:
        want = {"train": n_train, "test": n_test}
        out: dict[str, list[Problem]] = {"train": [], "test": []}
        seen: set[str] = set()
        for index in range(max_draws):
            if all(len(out[s]) >= want[s] for s in want):
                break
            rng = random.Random(f"arithmetic:{data_seed}:{self.level}:{index}")
            text, answer, expression = generate_problem(self.level, rng)
            if text in seen:
                continue
            seen.add(text)
            in_test = text_hash_fraction(text, salt=f"arith{data_seed}") < test_fraction
            split = "test" if in_test else "train"
            if len(out[split]) < want[split]:
                out[split].append(
                    Problem(
                        uid=f"{self.name}:{data_seed}:{index}",
                        text=text,
                        answer=str(answer),
                        meta={
                            "level": self.level,
                            "expression": expression,
                            "n_ops": LEVELS[self.level].n_ops,
                        },
                    )
                )
        if any(len(out[s]) < want[s] for s in want):
            raise ValueError(
                f"{self.name}: could not draw {n_train} train + {n_test} test distinct problems "
                f"in {max_draws} draws; lower n_train/n_test"
            )
        return {s: tuple(v) for s, v in out.items()}

    def problems(self, split: str, seed: int = 0) -> Iterator[Problem]:
        """The split's problems in a seed-determined shuffled order."""
        if split not in self._splits:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        return shuffled(self._splits[split], seed)

    def score(self, transcript: Transcript) -> Score:
        """Grade the answering agent's output against the integer answer."""
        return grade(
            transcript.answer_text,
            transcript.problem.answer or "",
            last_number_fallback=self.last_number_fallback,
            timeout_s=self.timeout_s,
        )
