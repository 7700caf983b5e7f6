"""Classes of grading errors a careful human MATH grader would not sign (issue 38, part 2).

Each class has cases in both directions: what must match and what must not. Expected verdicts
are hand-derived from the mathematics and the stated policies (docs/tasks.md, "Math benchmarks
and grading"), not copied from our own output:
  * an exact gold needs an exact answer; closeness only for a decimal gold;
  * the last box is the final answer, even when empty; boxes joined by a connective form one
    answer;
  * a plain-text mixed number is its sum;
  * a percent gold is answered in percent; an inequality equals the interval it describes.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from marft_jax.envs.math_grading import extract_answer, grade, notation_value, rewrite_mixed_numbers


def _check(output: str, gold: str, expected: int) -> None:
    score = grade(output, gold)
    assert score.reward == expected, (output, gold, score.info)
    if expected == 0:
        assert score.info["reason"] in {"wrong", "no_answer"}, score.info


# ---------------------------------------------------------------------------------------------
# 1. An exact gold needs an exact answer; a decimal gold allows closeness (6 decimal places)
# ---------------------------------------------------------------------------------------------

EXACT_GOLD = [
    # rounded values of exact golds: never equal
    ("\\boxed{0.3333333333}", "\\frac{1}{3}", 0),
    ("\\boxed{0.6666666667}", "\\frac{2}{3}", 0),
    ("The answer is 0.1428571429.", "\\frac{1}{7}", 0),
    ("\\boxed{2.7182818285}", "e", 0),
    ("\\boxed{2.718281828459045235360287}", "e", 0),  # more digits than a float holds: still not e
    ("\\boxed{1.4142135624}", "\\sqrt{2}", 0),
    ("\\boxed{0.7071067812}", "\\frac{\\sqrt{2}}{2}", 0),
    ("\\boxed{3.1415926536}", "\\pi", 0),
    ("\\boxed{1.5707963268}", "\\frac{\\pi}{2}", 0),
    # expressions that only approximate e: finite compound-interest powers
    ("\\boxed{\\left(1+\\frac{1}{1000}\\right)^{1000}}", "e", 0),
    ("\\boxed{(1.0000001)^{10000000}}", "e", 0),
    ("\\boxed{(1+10^{-9})^{10^9}}", "e", 0),
    # rounded values inside an answer: a pair, an equation, a percentage, an endpoint
    ("\\boxed{(0.3333333333, 2)}", "\\left(\\frac{1}{3}, 2\\right)", 0),
    ("\\boxed{x = 0.3333333333}", "\\frac13", 0),
    ("\\boxed{33.33333333\\%}", "\\frac{1}{3}", 0),
    # a terminating decimal that equals the exact gold is that gold
    ("\\boxed{0.5}", "\\frac{1}{2}", 1),
    ("\\boxed{0.125}", "\\frac18", 1),
    ("\\boxed{-2.75}", "-\\frac{11}{4}", 1),
    ("\\boxed{2.50}", "\\frac{5}{2}", 1),
    ("\\boxed{3.0}", "3", 1),
    ("\\boxed{0.5\\pi}", "\\frac{\\pi}{2}", 1),
    ("\\boxed{1.5\\sqrt{2}}", "\\frac{3\\sqrt{2}}{2}", 1),
    ("\\boxed{0.1 + 0.2}", "\\frac{3}{10}", 1),  # exact decimal arithmetic, no binary rounding
    ("\\boxed{(0.5, 2)}", "\\left(\\frac12, 2\\right)", 1),
    ("\\boxed{\\begin{pmatrix} 0.5 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix} \\frac12 \\\\ 2 \\end{pmatrix}", 1),
    ("\\boxed{e^{1}}", "e", 1),
    # a decimal gold: closeness at 6 decimal places, both directions
    ("\\boxed{\\frac{1}{3}}", "0.333333", 1),
    ("\\boxed{\\pi}", "3.141593", 1),
    ("\\boxed{\\frac14}", "0.25", 1),
    ("\\boxed{\\pi}", "3.14", 0),
    ("\\boxed{0.33}", "0.333333", 0),
]


@pytest.mark.parametrize("output, gold, expected", EXACT_GOLD)
def test_exact_gold_needs_an_exact_answer(output, gold, expected):
    _check(output, gold, expected)


# ---------------------------------------------------------------------------------------------
# 2. Which answer is final
# ---------------------------------------------------------------------------------------------

FINAL_ANSWER = [
    # an empty last box: the response retracted its answer
    ("\\boxed{5}. Wait, that is wrong. Final answer: \\boxed{}", "5", 0),
    ("$\\boxed{12}$\nActually no.\n$\\boxed{ }$", "12", 0),
    ("So $x = \\boxed{3}$... no. I cannot decide: $\\boxed{\\text{}}$", "3", 0),
    ("Put the answer in \\boxed{} like this: \\boxed{7}", "7", 1),  # an earlier empty box
    # several boxes joined by a connective state one answer (a set)
    ("x = \\boxed{2} or x = \\boxed{-5}", "2, -5", 1),
    ("x = \\boxed{2} or x = \\boxed{-5}", "-5, 2", 1),
    ("x = \\boxed{2} or x = \\boxed{-5}", "\\{-5, 2\\}", 1),
    ("The solutions are $\\boxed{3}$ and $\\boxed{-\\frac{1}{2}}$.", "3, -\\frac12", 1),
    ("$x_1 = \\boxed{1}$, $x_2 = \\boxed{4}$", "1, 4", 1),
    ("$x = \\boxed{2} \\text{ or } x = \\boxed{-5}$", "-5,2", 1),
    ("\\boxed{3} and \\boxed{3}", "3", 1),  # a repeat is one answer
    ("x = \\boxed{2} or x = \\boxed{-5}", "-5", 0),  # two roots stated: not the single gold
    ("x = \\boxed{2} or x = \\boxed{-5}", "2, 5", 0),
    # a boxed intermediate then a boxed final: the later box replaces the earlier
    ("First \\boxed{2}, then corrected: \\boxed{-5}", "-5", 1),
    ("First \\boxed{2}, then corrected: \\boxed{-5}", "2, -5", 0),
    ("We get \\boxed{4}. Checking again, the answer is \\boxed{6}", "6", 1),
    ("We get \\boxed{4}. Checking again, the answer is \\boxed{6}", "4, 6", 0),
    ("\\boxed{5}, or rather \\boxed{6}", "6", 1),
    ("Part one: \\boxed{4},\n\n\\boxed{6}", "6", 1),  # another paragraph
]


@pytest.mark.parametrize("output, gold, expected", FINAL_ANSWER)
def test_final_answer(output, gold, expected):
    _check(output, gold, expected)


def test_empty_last_box_is_no_answer():
    assert extract_answer("\\boxed{5} is wrong, so: \\boxed{}") == (None, "empty_box")
    score = grade("\\boxed{5} is wrong, so: \\boxed{}", "5")
    assert score.info["reason"] == "no_answer" and score.info["extracted"] is None
    assert extract_answer("ok \\boxed{3} then truncated \\boxed{12") == ("3", "boxed")  # unclosed


@pytest.mark.parametrize(
    "text, answer",
    [
        ("x = \\boxed{2} or x = \\boxed{-5}", "2, -5"),
        ("$\\boxed{1}$, $\\boxed{2}$ and $\\boxed{3}$.", "1, 2, 3"),
        ("x &= \\boxed{2} \\\\ x &= \\boxed{-5}", "2, -5"),
        ("\\boxed{2} \\quad\\text{or}\\quad \\boxed{-5}", "2, -5"),
        ("\\boxed{1}, then corrected: \\boxed{2}", "2"),
        ("\\boxed{1/2}, i.e. \\boxed{0.5}", "0.5"),
        ("\\boxed{2} \\boxed{-5}", "-5"),  # no connective
    ],
)
def test_boxes_joined_by_a_connective(text, answer):
    assert extract_answer(text) == (answer, "boxed")


# ---------------------------------------------------------------------------------------------
# 3. A plain-text mixed number is its sum
# ---------------------------------------------------------------------------------------------

MIXED = [
    ("The answer is 2 1/2", "\\frac{5}{2}", 1),
    ("\\boxed{2 1/2}", "2.5", 1),
    ("\\boxed{3 3/4}", "\\frac{15}{4}", 1),
    ("She needs 1 1/3 cups of flour.", "\\frac43", 1),
    ("\\boxed{-2 1/2}", "-\\frac52", 1),
    ("\\boxed{x = 2 1/2}", "\\frac52", 1),
    ("The answer is 2 1/2 cups.", "\\frac52", 1),
    ("\\boxed{\\frac{5}{2}}", "2 1/2", 1),  # a mixed-number gold
    ("\\boxed{2\\frac{1}{2}}", "\\frac{5}{2}", 1),
    ("\\boxed{2 1/2}", "1", 0),  # not the product 2 * 1/2
    ("\\boxed{2 1/2}", "\\frac{21}{2}", 0),  # nor 21/2 once spaces are dropped
    ("\\boxed{2 \\cdot 1/2}", "1", 1),  # an explicit product stays a product
    ("\\boxed{2 \\cdot 1/2}", "\\frac52", 0),
    ("\\boxed{2 * 1/2}", "1", 1),
]


@pytest.mark.parametrize("output, gold, expected", MIXED)
def test_mixed_numbers(output, gold, expected):
    _check(output, gold, expected)


def test_mixed_number_rewrite_and_value():
    assert notation_value("2 1/2") == Fraction(5, 2)
    assert notation_value("-2\\frac{1}{3}") == Fraction(-7, 3)
    assert notation_value("2 3/2") is None  # an improper fraction: not a mixed number
    assert rewrite_mixed_numbers("x = 2 1/2") == "x = {\\frac{5}{2}}"
    for unchanged in ("2 \\cdot 1/2", "x^2 1/2", "3/4 1/2", "2 1/2x", "2 3/2"):
        assert rewrite_mixed_numbers(unchanged) == unchanged


# ---------------------------------------------------------------------------------------------
# 4. Policies: a percent gold is answered in percent; inequality = interval
# ---------------------------------------------------------------------------------------------

PERCENT = [
    ("\\boxed{0.25}", "25\\%", 0),
    ("\\boxed{\\frac{1}{4}}", "25\\%", 0),
    ("The answer is 0.125", "12.5\\%", 0),
    ("\\boxed{25}", "25\\%", 1),
    ("\\boxed{25\\%}", "25\\%", 1),
    ("The answer is 25 percent.", "25\\%", 1),
    ("\\boxed{12.5}", "12.5\\%", 1),
    ("\\boxed{25\\%}", "0.25", 1),  # the sign states the unit: 25 % = 0.25
]


@pytest.mark.parametrize("output, gold, expected", PERCENT)
def test_percent_gold(output, gold, expected):
    _check(output, gold, expected)


INTERVALS = [
    ("\\boxed{x > 2}", "(2, \\infty)", 1),
    ("\\boxed{2 < x}", "(2, \\infty)", 1),
    ("\\boxed{x \\ge 2}", "[2,\\infty)", 1),
    ("\\boxed{x >= 2}", "[2,\\infty)", 1),
    ("\\boxed{1 < x < 3}", "(1,3)", 1),
    ("\\boxed{-3 \\le x \\le 3}", "[-3, 3]", 1),
    ("\\boxed{x \\le -1 \\text{ or } x > 2}", "(-\\infty,-1] \\cup (2,\\infty)", 1),
    ("The answer is $x \\leq -1$ or $x > 2$.", "(-\\infty,-1] \\cup (2,\\infty)", 1),
    ("\\boxed{x > 2 \\text{ or } x < -1}", "(-\\infty,-1)\\cup(2,\\infty)", 1),
    ("\\boxed{x \\neq 0}", "(-\\infty,0)\\cup(0,\\infty)", 1),
    ("\\boxed{(2, \\infty)}", "x > 2", 1),  # the gold is the inequality
    ("\\boxed{t > 2}", "(2,\\infty)", 1),
    ("\\boxed{x > 0.5}", "\\left(\\frac12,\\infty\\right)", 1),
    ("\\boxed{x \\ge 2}", "(2,\\infty)", 0),
    ("\\boxed{x > 2}", "[2,\\infty)", 0),
    ("\\boxed{x < 2}", "(2,\\infty)", 0),
    ("\\boxed{1 \\le x < 3}", "(1,3)", 0),
    ("\\boxed{x < -1 \\text{ or } x > 2}", "(-\\infty,-1] \\cup (2,\\infty)", 0),
    ("\\boxed{x \\le -1 \\text{ and } x > 2}", "(-\\infty,-1] \\cup (2,\\infty)", 0),
    ("\\boxed{x > 0.3333333333}", "\\left(\\frac13,\\infty\\right)", 0),  # a rounded endpoint
    ("\\boxed{x > 2, x < -1}", "(-\\infty,-1)\\cup(2,\\infty)", 0),  # a comma: "and" or "or"?
]


@pytest.mark.parametrize("output, gold, expected", INTERVALS)
def test_inequality_equals_its_interval(output, gold, expected):
    _check(output, gold, expected)
