"""Arithmetic word problems (marft_jax.envs.arithmetic): determinism, exact answers, splits."""

from __future__ import annotations

import ast
import random
import re
from fractions import Fraction

import pytest

from marft_jax.envs.arithmetic import LEVELS, ArithmeticTask, generate_problem
from marft_jax.envs.task import Task, Transcript


def evaluate(expression: str) -> tuple[Fraction, list[Fraction]]:
    """Independent oracle: exact value of a + - * / expression and all partial results."""
    partials: list[Fraction] = []

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            ops = {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}
            value = ops[type(node.op)] if type(node.op) in ops else a / b
            partials.append(value)
            return value
        raise AssertionError(f"unexpected node {ast.dump(node)}")

    return ev(ast.parse(expression, mode="eval").body), partials


def test_level1_reads_like_a_simple_word_problem():
    text, answer, expression = generate_problem(1, random.Random(0))
    assert text.endswith("have now?") and " has " in text
    assert len(re.findall(r"[+\-*/]", expression)) == 1
    assert evaluate(expression)[0] == answer


def test_determinism_per_seed():
    a = ArithmeticTask(level=3, n_train=50, n_test=20, data_seed=5)
    b = ArithmeticTask(level=3, n_train=50, n_test=20, data_seed=5)
    c = ArithmeticTask(level=3, n_train=50, n_test=20, data_seed=6)
    for split in ("train", "test"):
        assert list(a.problems(split, seed=1)) == list(b.problems(split, seed=1))
    assert [p.text for p in a.problems("train")] != [p.text for p in c.problems("train")]
    # the iteration seed reorders but never changes a split's contents
    order0, order1 = list(a.problems("train", seed=0)), list(a.problems("train", seed=1))
    assert [p.uid for p in order0] != [p.uid for p in order1]
    assert sorted(p.uid for p in order0) == sorted(p.uid for p in order1)


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_answers_match_independent_evaluation(level):
    task = ArithmeticTask(level=level, n_train=150, n_test=50, data_seed=1)
    for split in ("train", "test"):
        for p in task.problems(split):
            value, partials = evaluate(p.meta["expression"])
            assert value.denominator == 1 and str(value.numerator) == p.answer
            assert all(v.denominator == 1 and v > 0 for v in partials), p.meta["expression"]
            numbers = [int(n) for n in re.findall(r"\d+", p.meta["expression"])]
            assert all(str(n) in p.text for n in numbers)  # every operand is stated in the text
            assert len(partials) == LEVELS[level].n_ops == p.meta["n_ops"]


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_splits_are_disjoint_and_sized(level):
    task = ArithmeticTask(level=level, n_train=300, n_test=60, data_seed=2)
    train = [p.text for p in task.problems("train")]
    test = [p.text for p in task.problems("test")]
    assert len(train) == 300 and len(test) == 60
    assert len(set(train)) == 300 and len(set(test)) == 60
    assert not set(train) & set(test)


def test_levels_increase_operation_count_and_size():
    ops = [LEVELS[level].n_ops for level in sorted(LEVELS)]
    assert ops == sorted(ops) and len(set(ops)) == len(ops) and ops[0] <= 2
    mean_ops = []
    for level in sorted(LEVELS):
        task = ArithmeticTask(level=level, n_train=20, n_test=5)
        mean_ops.append(sum(len(re.findall(r"[+\-*/]", p.meta["expression"])) for p in task.problems("train")) / 20)
    assert mean_ops == sorted(mean_ops) and mean_ops[0] < mean_ops[-1]


def test_task_protocol_and_scoring():
    task = ArithmeticTask(level=1, n_train=5, n_test=5)
    assert isinstance(task, Task)
    assert task.name == "arithmetic-l1" and task.kind == "math"
    problem = next(task.problems("test"))
    gold = int(problem.answer)
    right = Transcript(problem, ("thinking", f"So the total is \\boxed{{{gold}}}."), answer_agent=1)
    wrong = Transcript(problem, ("thinking", f"\\boxed{{{gold + 1}}}"), answer_agent=1)
    none = Transcript(problem, ("thinking", "no idea"), answer_agent=1)
    assert task.score(right).reward == 1.0
    assert task.score(wrong).reward == 0.0 and task.score(wrong).info["reason"] == "wrong"
    assert task.score(none).info["reason"] == "no_answer"


def test_seven_example_and_bad_arguments():
    task = ArithmeticTask(level=1, n_train=200, n_test=5)
    seven = next(p for p in task.problems("train") if p.answer == "7")
    assert task.score(Transcript(seven, ("\\boxed{7}",), 0)).reward == 1.0
    assert task.score(Transcript(seven, ("\\boxed{8}",), 0)).reward == 0.0
    with pytest.raises(ValueError, match="level"):
        ArithmeticTask(level=6)
    with pytest.raises(ValueError, match="split"):
        task.problems("dev")
    with pytest.raises(ValueError, match="could not draw"):
        ArithmeticTask(level=1, n_train=200, n_test=1, max_draws=100)
