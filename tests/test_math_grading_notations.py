"""Number notations and justified answers in math grading (marft_jax.envs.math_grading).

Scientific notation and repeating decimals as written in plain text, and a final answer
followed by its justification. Expected verdicts are hand-derived from the mathematics
(``0.1(6)`` = 1/6, ``1.5e3`` = 1500), not copied from our own output.
"""

from __future__ import annotations

import time
from fractions import Fraction

import pytest

from marft_jax.envs.math_grading import (
    VerifyWorker,
    extract_answer,
    grade,
    notation_value,
    numeric_equal,
    repeated_tail,
    rewrite_notation,
)

F = Fraction

# ---------------------------------------------------------------------------------------------
# Exact values of notations
# ---------------------------------------------------------------------------------------------

NOTATION_VALUES = [
    # scientific
    ("1.5e3", F(1500)),
    ("1.5E+3", F(1500)),
    ("2.5e-4", F(1, 4000)),
    ("-3e2", F(-300)),
    ("1.5 x 10^3", F(1500)),
    ("1.5x10^-3", F(3, 2000)),
    ("1.5 × 10^3", F(1500)),
    ("1.5*10^3", F(1500)),
    ("1.5 \\times 10^{3}", F(1500)),
    ("6.02 \\cdot 10^{23}", F(602) * 10**21),
    ("$4 \\times 10^{-2}$", F(1, 25)),
    # repeating: parentheses, overline, dots
    ("0.(3)", F(1, 3)),
    ("0.(142857)", F(1, 7)),
    ("1.2(3)", F(37, 30)),
    ("0.1(6)", F(1, 6)),
    ("-0.(3)", F(-1, 3)),
    (".(3)", F(1, 3)),
    ("0.(9)", F(1)),
    ("0.\\overline{3}", F(1, 3)),
    ("0.1\\overline{6}", F(1, 6)),
    ("0.\\overline{36}", F(4, 11)),
    ("2.\\bar{3}", F(7, 3)),
    ("0.\\dot{3}", F(1, 3)),
    ("0.1\\dot{6}", F(1, 6)),
    ("0.\\dot{1}4285\\dot{7}", F(1, 7)),
    # repeating: ellipsis only when a block is visibly repeated
    ("0.333...", F(1, 3)),
    ("0.33...", F(1, 3)),
    ("0.1666...", F(1, 6)),
    ("0.142857142857...", F(1, 7)),
    ("0.1212\\ldots", F(4, 33)),
    ("0.666\u2026", F(2, 3)),
    ("1.8333\\dots", F(11, 6)),
    # repeating: the word
    ("0.3 repeating", F(1, 3)),
    ("0.142857 repeating", F(1, 7)),
    ("0.1666 recurring", F(1, 6)),
    ("0.16 repeating", F(16, 99)),  # no visible repeated block: all the decimals repeat
    ("0.6 (repeating)", F(2, 3)),
]


@pytest.mark.parametrize("answer, value", NOTATION_VALUES)
def test_notation_value(answer, value):
    assert notation_value(answer) == value


@pytest.mark.parametrize(
    "answer",
    [
        "0.33",  # plain decimals keep their finite value
        "0.3333",
        "1500",
        "0.3...",  # a single digit before the ellipsis is not visibly repeated
        "3.14159...",  # truncation, not repetition
        "2(3)",  # no decimal point: a product
        "5x",
        "2e",
        "1.5 x 10",  # no exponent
        "1.5 x 2^3",  # base 2 is not scientific notation
        "x = 1.5e3",  # the whole answer must be the number
        "1e999999",  # exponent over the cap: left for math-verify under the time limit
        "1e" + "9" * 5000,
        "0.(" + "3" * 5000 + ")",
    ],
)
def test_not_a_notation(answer):
    assert notation_value(answer) is None
    assert rewrite_notation(answer) == answer


@pytest.mark.parametrize(
    "digits, split",
    [("333", ("33", "3")), ("1666", ("166", "6")), ("1212", ("12", "12")), ("3", None), ("14159", None)],
)
def test_repeated_tail(digits, split):
    assert repeated_tail(digits) == split


def test_rewrite_gives_exact_latex():
    assert rewrite_notation("1.5e3") == "1500"
    assert rewrite_notation("0.(3)") == "\\frac{1}{3}"
    assert rewrite_notation("-1.2(3)") == "-\\frac{37}{30}"


# ---------------------------------------------------------------------------------------------
# Grading with notations: (model output, gold, expected reward)
# ---------------------------------------------------------------------------------------------

NOTATION_GRADES = [
    # scientific, positives
    ("\\boxed{1.5e3}", "1500", 1),
    ("\\boxed{1.5E+3}", "1500", 1),
    ("\\boxed{1.5 x 10^3}", "1500", 1),
    ("\\boxed{1.5 × 10^3}", "1500", 1),
    ("\\boxed{1.5*10^3}", "1500", 1),
    ("\\boxed{1.5 \\times 10^{3}}", "1500", 1),
    ("\\boxed{2.5e-4}", "0.00025", 1),
    ("\\boxed{2.5e-4}", "\\frac{1}{4000}", 1),
    ("\\boxed{1500}", "1.5 \\times 10^{3}", 1),  # notation on the gold side
    ("\\boxed{3 \\times 10^8}", "3e8", 1),
    # scientific, near misses
    ("\\boxed{1.5e3}", "1501", 0),
    ("\\boxed{1.5 x 10^3}", "15000", 0),
    ("\\boxed{1.5 x 10^3}", "150", 0),
    ("\\boxed{2.5e-4}", "0.0025", 0),
    ("\\boxed{1.5e-3}", "1500", 0),
    ("\\boxed{-1.5e3}", "1500", 0),
    # repeating, positives
    ("\\boxed{0.333...}", "\\frac{1}{3}", 1),
    ("\\boxed{0.(3)}", "\\frac{1}{3}", 1),
    ("\\boxed{0.\\overline{3}}", "\\frac{1}{3}", 1),
    ("\\boxed{0.1\\overline{6}}", "\\frac{1}{6}", 1),
    ("\\boxed{0.1(6)}", "\\frac{1}{6}", 1),
    ("\\boxed{0.(142857)}", "\\frac{1}{7}", 1),
    ("\\boxed{1.2(3)}", "\\frac{37}{30}", 1),
    ("\\boxed{0.3 repeating}", "\\frac{1}{3}", 1),
    ("\\boxed{0.\\dot{3}}", "\\frac{1}{3}", 1),
    ("\\boxed{0.1666...}", "1/6", 1),
    ("\\boxed{0.142857142857...}", "\\frac17", 1),
    ("\\boxed{\\frac{4}{11}}", "0.\\overline{36}", 1),  # notation on the gold side
    ("\\boxed{-0.(6)}", "-\\frac{2}{3}", 1),
    # repeating, near misses
    ("\\boxed{0.(3)}", "0.3", 0),
    ("\\boxed{0.3}", "0.\\overline{3}", 0),
    ("\\boxed{0.33}", "\\frac{1}{3}", 0),
    ("\\boxed{0.16}", "\\frac{1}{6}", 0),
    ("\\boxed{0.(16)}", "\\frac{1}{6}", 0),  # 16/99
    ("\\boxed{0.16 repeating}", "\\frac{1}{6}", 0),  # 16/99 by the word rule
    ("\\boxed{0.3...}", "\\frac{1}{3}", 0),  # not visibly repeated: read as 0.3
    ("\\boxed{0.\\overline{3}}", "0.33", 0),
    ("\\boxed{1.2(3)}", "3.6", 0),  # a repetend, not 1.2 * 3
    ("\\boxed{0.(3)}", "-\\frac{1}{3}", 0),
]


@pytest.mark.parametrize("output, gold, expected", NOTATION_GRADES)
def test_notation_grading(output, gold, expected):
    score = grade(output, gold)
    assert score.reward == expected, score.info
    if expected == 0:
        assert score.info["reason"] == "wrong"


def test_plain_decimals_keep_the_existing_tolerance():
    """No notation, no change: math-verify compares after rounding to 6 decimal places."""
    assert grade("\\boxed{0.3333}", "\\frac{1}{3}").reward == 0.0
    assert grade("\\boxed{0.333333}", "\\frac{1}{3}").reward == 1.0


# ---------------------------------------------------------------------------------------------
# A stated answer followed by its justification
# ---------------------------------------------------------------------------------------------

JUSTIFIED = [
    ("The answer is 12 because 3 * 4 = 12.", "12"),
    ("The answer is 7, since 10 - 3 = 7", "7"),
    ("So the final answer is 42 as 6 times 7 is 42", "42"),
    ("The answer is 5 since there are 2 + 3 = 5 apples", "5"),
    ("The answer is 12 because 4 groups of 3", "12"),  # a different number in the reason
    ("The answer is 8, because 2^3", "8"),
    ("The answer is 12 (because 3*4)", "12"),
    ("The answer is 9; hence 3^2 works", "9"),
    ("Final answer: 3 since 6/2 = 3", "3"),
    ("The answer is $\\frac{1}{2}$ since half of them left.", "\\frac{1}{2}"),
    ("The answer is (1, 2), since both work.", "(1, 2)"),
    ("The answer is 2 and 3.", "2 and 3"),  # "and" is not a justification
    ("The answer is 1.5 x 10^3 because 1500 = 1.5 * 1000.", "1.5 x 10^3"),
    ("The answer is 0.333... because 1/3 repeats.", "0.333..."),
    ("The answer is 0.333....", "0.333..."),  # ellipsis then a full stop
    ("the answer is 0.3 repeating since 3/9 = 1/3", "0.3 repeating"),
]


@pytest.mark.parametrize("text, answer", JUSTIFIED)
def test_justification_is_cut(text, answer):
    assert extract_answer(text) == (answer, "answer_is")


LAST_NUMBERS = [
    ("so we get 2.5e-4", "2.5e-4"),
    ("so x = 0.(3)", "0.(3)"),
    ("the speed is 3 x 10^8", "3 x 10^8"),
    ("we get 0.1666... for x", "0.1666..."),
    ("Hmm.... 7 wait....", "7"),
    ("It is 2(3) = 6", "6"),
]


@pytest.mark.parametrize("text, answer", LAST_NUMBERS)
def test_last_number_takes_notations_whole(text, answer):
    assert extract_answer(text) == (answer, "last_number")


JUSTIFIED_GRADES = [
    ("The answer is 12 because 4 groups of 3", "12", 1),
    ("The answer is 12 because 4 groups of 3", "3", 0),
    ("The answer is 8, because 2^3", "8", 1),
    ("The answer is 8, because 2^3", "3", 0),
    ("The answer is 7, since 10 - 3 = 7", "10", 0),
    ("The answer is 1.5 x 10^3 because 1.5 thousand", "1500", 1),
    ("The answer is 1.5 x 10^3 because 1.5 thousand", "1.5", 0),
    ("The answer is 0.1666... since it is one sixth", "\\frac{1}{6}", 1),
    ("The answer is 0.(3), as 1/3 = 0.333...", "\\frac{1}{3}", 1),
]


@pytest.mark.parametrize("output, gold, expected", JUSTIFIED_GRADES)
def test_justified_answer_grading(output, gold, expected):
    score = grade(output, gold)
    assert score.reward == expected, score.info
    assert score.info["extracted_from"] == "answer_is"


# ---------------------------------------------------------------------------------------------
# Pathological sizes stay bounded
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("a, b", [("1e999999", "1"), ("1e" + "9" * 5000, "1"), ("1e400", "1")])
def test_numeric_fallback_never_overflows(a, b):
    assert numeric_equal(a, b) in (None, False)


def test_numeric_fallback_is_exact_for_large_numbers():
    assert numeric_equal("1e400", "1e400") is True
    assert numeric_equal("1e300", "1.00001e300") is True  # within 1e-4 relative
    assert numeric_equal("1e300", "1.001e300") is False


def test_huge_exponents_return_within_the_time_limit():
    worker = VerifyWorker(startup_timeout_s=60)
    try:
        worker.check("1", "1", timeout_s=30)  # start the worker outside the timed region
        huge = ("\\boxed{1e999999}", "\\boxed{1.5 \\times 10^{99999999}}", "\\boxed{1e" + "9" * 5000 + "}")
        for output in huge:
            start = time.monotonic()
            score = grade(output, "1", timeout_s=2.0, worker=worker)
            assert score.reward == 0.0, score.info
            assert time.monotonic() - start < 2.0 + 30.0  # the limit plus a worker restart
    finally:
        worker.close()
