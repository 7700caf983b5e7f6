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


def test_plain_decimals_are_not_an_exact_gold():
    """A plain decimal keeps its finite value: no rounding makes it 1/3 (issue 38)."""
    assert grade("\\boxed{0.3333}", "\\frac{1}{3}").reward == 0.0
    assert grade("\\boxed{0.333333}", "\\frac{1}{3}").reward == 0.0


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


# ---------------------------------------------------------------------------------------------
# More notations as people write them (issue 18): plain-text and Unicode scientific notation,
# repeating decimals in every common spelling. Values hand-derived: 3.2e5 = 320000,
# 1.2(34) = 1.2343434... = 611/495, 0.58(3) = 7/12.
# ---------------------------------------------------------------------------------------------

MORE_NOTATION_VALUES = [
    # scientific, ASCII
    ("3.2e5", F(320000)),
    ("3.2E+05", F(320000)),
    ("3.2e+5", F(320000)),
    ("3.2E-05", F(1, 31250)),
    ("-3.2e5", F(-320000)),
    (".5e2", F(50)),
    ("3.2 x 10^5", F(320000)),
    ("3.2 X 10^5", F(320000)),
    ("3.2x10^5", F(320000)),
    ("3.2*10**5", F(320000)),
    ("3.2 * 10 ** 5", F(320000)),
    ("3.2 x 10^(5)", F(320000)),
    ("3.2 x 10^{+5}", F(320000)),
    ("3.2 x 10^{-5}", F(1, 31250)),
    ("32 x 10^4", F(320000)),
    ("0.32 x 10^6", F(320000)),
    # scientific, LaTeX
    ("3.2 \\times 10^{5}", F(320000)),
    ("3.2\\times10^{5}", F(320000)),
    ("3.2 \\cdot 10^{5}", F(320000)),
    ("3.2 \\times 10^5", F(320000)),
    ("$3.2 \\times 10^{5}$", F(320000)),
    # scientific, Unicode: ×, ·, ⋅, superscript exponents, the minus sign
    ("3.2 \u00d7 10^5", F(320000)),
    ("3.2\u00d710\u2075", F(320000)),
    ("3.2 \u00b7 10^5", F(320000)),
    ("3.2 \u22c5 10^5", F(320000)),
    ("1.5\u00b710\u207b\u00b3", F(3, 2000)),
    ("1.5 \u00d7 10\u207b\u00b3", F(3, 2000)),
    ("\u22123.2e5", F(-320000)),
    ("2.5 \u00d7 10\u207b\u2074", F(1, 4000)),
    # units after the number
    ("3.2e5 meters", F(320000)),
    ("3 x 10^8 m/s", F(300000000)),
    # repeating: parentheses, brackets, overline, bar, dots
    ("1.2(34)", F(611, 495)),
    ("2.(142857)", F(15, 7)),
    ("0.8(3)", F(5, 6)),
    ("0.[3]", F(1, 3)),
    ("0.\\overline{142857}", F(1, 7)),
    ("1.\\overline{09}", F(12, 11)),
    ("0.0\\overline{3}", F(1, 30)),
    ("0.\\bar 3", F(1, 3)),
    ("0.\\dot 3", F(1, 3)),
    ("0.\\dot{1}\\dot{8}", F(2, 11)),
    ("0.58\\dot{3}", F(7, 12)),
    ("\u22120.(6)", F(-2, 3)),
    # repeating: a combining overline over the digits (0.3̅, 0.16̅)
    ("0.3\u0305", F(1, 3)),
    ("0.16\u0305", F(1, 6)),
    ("0.1\u03056\u0305", F(16, 99)),
    # repeating: an ellipsis after a visibly repeated block
    ("0.999...", F(1)),
    ("0.0909...", F(1, 11)),
    ("2.333...", F(7, 3)),
    ("0.8333\u2026", F(5, 6)),
    # repeating: words
    ("0.3 recurring", F(1, 3)),
    ("0.3 repeats", F(1, 3)),
    ("0.3 repeated", F(1, 3)),
    ("0.33 recurring", F(1, 3)),
    ("0.1 with 6 repeating", F(1, 6)),
    ("0.16 with the 6 repeating", F(1, 6)),
    ("0.1666 (6 repeating)", F(1, 6)),
    ("0.45 with 45 repeating", F(5, 11)),
    ("0.3 repeating cm", F(1, 3)),
]


@pytest.mark.parametrize("answer, value", MORE_NOTATION_VALUES)
def test_more_notation_values(answer, value):
    assert notation_value(answer) == value


@pytest.mark.parametrize(
    "answer",
    [
        "0.333",  # a plain decimal
        "320000",
        "3.2e5x",
        "3.2 x 10^5 x",  # a single letter after it is a variable, not a unit
        "3.2 x 10",
        "3.2 10^5",  # no multiplication sign
        "3.2e5 + 1",
        "10^5",  # a bare power: math-verify reads it
        "10^10^10^10",
        "1e999999999",  # exponent over the cap
        "3.2 \\times 10^{999999999}",
        "2(34)",  # no decimal point: a product
        "0.(3",  # unclosed
        "0.()",
        "0.1 with 6",  # no repeating word
        "e5",
        "0." + "3" * 5000 + "...",  # over the size cap
        "3 log 10",
        "1.5 million",  # a magnitude word is a unit, as in GSM8K (see test_magnitude_word_is_a_unit)
    ],
)
def test_more_non_notations(answer):
    assert notation_value(answer) is None


# (model output, gold, reward): notations in prose, outside \boxed.
MORE_NOTATION_GRADES = [
    # scientific, positives
    ("The answer is 3.2e5.", "320000", 1),
    ("The answer is 3.2E+05", "320000", 1),
    ("The answer is 3.2 x 10^5", "320000", 1),
    ("The answer is 3.2 \u00d7 10^5.", "3.2 \\times 10^{5}", 1),
    ("The answer is 3.2*10**5", "320000", 1),
    ("The answer is $3.2 \\times 10^{5}$.", "320000", 1),
    ("Answer: 1.5\u00b710\u207b\u00b3", "0.0015", 1),
    ("Answer: 1.5\u00b710\u207b\u00b3", "\\frac{3}{2000}", 1),
    ("So the distance is 3.2e5 km.", "320000", 1),
    ("so v = 3.2 \u22c5 10^5", "320000", 1),
    ("the answer is 2.5 \u00d7 10\u207b\u2074", "0.00025", 1),
    ("\\boxed{3.2 \\cdot 10^{5}}", "320000", 1),
    ("\\boxed{\u22124}", "-4", 1),
    ("The answer is \u22123.2e5", "-320000", 1),
    ("There are 10\u2075 ways", "100000", 1),
    ("The answer is 320000", "3.2 \\times 10^{5}", 1),
    # scientific, near misses: same digits, other exponent or sign; the mantissa; the exponent
    ("The answer is 3.2e5", "32000", 0),
    ("The answer is 3.2e5", "3200000", 0),
    ("The answer is 3.2e5", "3.2", 0),
    ("The answer is 3.2 x 10^5", "320001", 0),
    ("The answer is 3.2 x 10^5", "5", 0),
    ("The answer is 3.2 x 10^5", "10^5", 0),
    ("The answer is 3.2e-5", "320000", 0),
    ("The answer is 3.2E+05", "0.000032", 0),
    ("The answer is -3.2e5", "320000", 0),
    ("Answer: 1.5\u00b710\u207b\u00b3", "0.015", 0),
    ("Answer: 1.5\u00b710\u207b\u00b3", "1500", 0),
    ("so v = 3.2 \u22c5 10^5", "5", 0),
    ("There are 10\u2075 ways", "5", 0),
    ("The answer is 32000", "3.2 \\times 10^{5}", 0),
    # repeating, positives
    ("The answer is 0.333...", "\\frac{1}{3}", 1),
    ("The answer is 0.(3).", "\\frac13", 1),
    ("The answer is $0.\\overline{3}$.", "1/3", 1),
    ("The answer is 0.3 repeating", "\\frac{1}{3}", 1),
    ("The answer is $0.\\dot{3}$", "\\frac{1}{3}", 1),
    ("The answer is 0.1(6)", "\\frac{1}{6}", 1),
    ("The answer is 1.2(34)", "\\frac{611}{495}", 1),
    ("The answer is 0.3\u0305", "\\frac{1}{3}", 1),
    ("So x = 0.1666...", "\\frac{1}{6}", 1),
    ("so x = 1.2(34)", "\\frac{611}{495}", 1),
    ("The answer is 0.1 with 6 repeating.", "\\frac{1}{6}", 1),
    ("the answer is 2.(142857)", "\\frac{15}{7}", 1),
    ("The answer is 0.999...", "1", 1),
    ("The answer is \\frac{1}{6}", "0.1\\overline{6}", 1),
    ("\\boxed{0.(142857)}", "0.142857", 1),  # math-verify's documented 6-decimal rounding
    # repeating, near misses: the truncation, the repetend read as a factor, another repetend
    ("The answer is 0.333", "\\frac{1}{3}", 0),
    ("The answer is 0.3333", "\\frac13", 0),
    ("The answer is 0.33333", "\\frac13", 0),
    ("The answer is 0.(3)", "0.333", 0),
    ("The answer is 0.(3)", "3", 0),
    ("The answer is 1.2(34)", "1.234", 0),
    ("The answer is 1.2(34)", "\\frac{37}{30}", 0),  # 1.2333...
    ("\\boxed{1.2(34)}", "40.8", 0),  # not 1.2 * 34
    ("The answer is 0.1(6)", "0.16", 0),
    ("The answer is 0.(6)", "\\frac{1}{3}", 0),
    ("The answer is 0.\\overline{3}", "\\frac{3}{10}", 0),
    ("The answer is 0.3 repeating", "0.3", 0),
    ("The answer is 0.\\dot{3}", "0.3", 0),
    ("The answer is 0.333...", "0.33", 0),
    ("The answer is 0.(3)", "-\\frac{1}{3}", 0),
    ("The answer is 0.16", "0.1\\overline{6}", 0),
    ("The answer is 0.3\u0305", "0.3", 0),
]


@pytest.mark.parametrize("output, gold, expected", MORE_NOTATION_GRADES)
def test_more_notation_grading(output, gold, expected):
    score = grade(output, gold)
    assert score.reward == expected, score.info
    if expected == 0:
        assert score.info["reason"] == "wrong"


@pytest.mark.parametrize(
    "text, answer",
    [
        ("so v = 3.2 \u22c5 10^5", "3.2 \u22c5 10^5"),
        ("the mass is 1.5\u00b710\u207b\u00b3 kg", "1.5\u00b710^{-3}"),
        ("There are 10\u2075 ways", "10^{5}"),
        ("we get 2^10 subsets", "2^10"),
        ("so x = 1.2(34)", "1.2(34)"),
        ("so x = 0.3\u0305", "0.\\overline{3}"),
        ("the population is 1.5 million", "1.5"),
        ("the area is 980 cm\u00b3", "980"),  # an exponent alone is never the answer
        ("so the area is 25 m^2", "25"),
        ("so x_{1} = 4", "4"),
        ("it costs \u22125 dollars", "-5"),
        ("The range is 2\u20135", "5"),  # an en dash between numbers is a range, not a minus
    ],
)
def test_last_number_reads_more_notations(text, answer):
    assert extract_answer(text) == (answer, "last_number")


@pytest.mark.parametrize(
    "output, gold, expected",
    [
        ("The answer is $4 million.", "4", 1),  # GSM8K: "how many millions ..." has gold 4
        ("There is 32 - 28 = $4 million to manage public spaces.", "4", 1),
        ("The answer is $4 million.", "5", 0),
        ("\\boxed{2.5 \\text{ billion}}", "2.5", 1),
    ],
)
def test_magnitude_word_is_a_unit(output, gold, expected):
    assert grade(output, gold).reward == expected


def test_plain_decimals_tolerance_matches_the_documented_rounding():
    """An exact gold needs an exact answer (issue 38); only a decimal gold keeps math-verify's
    6-decimal rounding: 1/7 matches 0.142857, 0.14285 does not."""
    assert grade("\\boxed{0.3333333}", "\\frac{1}{3}").reward == 0.0
    assert grade("\\boxed{0.333}", "\\frac{1}{3}").reward == 0.0
    assert grade("\\boxed{0.142857}", "\\frac{1}{7}").reward == 0.0
    assert grade("\\boxed{\\frac{1}{7}}", "0.142857").reward == 1.0
    assert grade("\\boxed{0.14285}", "0.142857").reward == 0.0


# ---------------------------------------------------------------------------------------------
# Pathological answers return within the hard time limit
# ---------------------------------------------------------------------------------------------


def test_huge_integers_are_compared_exactly_without_the_worker():
    big = "9" * 5000  # over Python's 4300-digit int() limit
    assert grade(f"\\boxed{{{big}}}", big).reward == 1.0
    score = grade(f"The answer is {big}", big[:-1] + "8")
    assert score.reward == 0.0 and score.info["method"] == "integer"
    assert grade(f"\\boxed{{00{big}}}", big).info["method"] == "integer"


def test_pathological_answers_return_within_the_time_limit():
    worker = VerifyWorker(startup_timeout_s=60)
    limit = 1.5
    try:
        worker.check("1", "1", timeout_s=30)  # start the worker outside the timed region
        outputs = [
            "The answer is 1e999999999",
            "\\boxed{10^10^10^10}",
            "The answer is 10^{10^{10^{10}}}",
            "So x = 3.2 \\times 10^{999999999}",
            "The answer is " + "9" * 100_000,
            "The answer is 0." + "3" * 20_000 + "...",
            "The answer is 1.5\u00b710\u207b" + "\u2079" * 50,
        ]
        for output in outputs:
            starts = worker.starts
            start = time.monotonic()
            score = grade(output, "\\frac{1}{3}", timeout_s=limit, worker=worker)
            elapsed = time.monotonic() - start
            assert score.reward == 0.0, (output[:40], score.info)
            # the limit (a killed worker is replaced on the next call: allow its start-up there)
            restarted = worker.starts > starts
            assert elapsed < limit + 2.0 + (30.0 if restarted else 0.0), (output[:40], elapsed)
    finally:
        worker.close()
