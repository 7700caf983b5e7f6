"""A final answer stated and then justified, in math grading (marft_jax.envs.math_grading).

"The answer is 12 because 3*4 = 12", "x = 7, since 2x = 14", "**Answer:** 12 — from 4 groups
of 3": the reward must follow the stated answer, never a number of the justification. Cases
are hand-written: positives (the stated answer is read), near misses (the justification holds
a different number, which must not be read, or the gold is that other number), and negatives
(text where a justification word is not a justification, so the last number still wins).
Extraction and grading of these texts is independent of the worker's verdict except where
graded; a last test bounds the extraction time on adversarial texts (it runs outside the
worker's hard time limit, in the trainer's process).
"""

from __future__ import annotations

import time

import pytest

from marft_jax.envs.math_grading import extract_answer, grade, stated_answer, strip_units

# ---------------------------------------------------------------------------------------------
# After an "answer is" marker: (text, stated answer)
# ---------------------------------------------------------------------------------------------

MARKER_JUSTIFIED = [
    # the marker itself: "My answer is", "Answer:", "**Answer:**", "Final Answer:", any case
    ("**Answer:** 12 \u2014 from 4 groups of 3", "12"),
    ("**Answer:** 12\u2014from 4 groups of 3", "12"),
    ("**Answer**: 12 because 4 * 3 = 12", "12"),
    ("Answer: 12 -- from 4 groups of 3", "12"),
    ("Answer: 12 \u2013 from 4 groups of 3", "12"),  # en dash between spaces, not a minus
    ("Answer: 12 - from 4 groups of 3", "12"),  # a hyphen before prose
    ("ANSWER: 12 because 3*4 = 12", "12"),
    ("My answer is 12 because 4 groups of 3 make 12.", "12"),
    ("My final answer is 42, since 6 * 7 = 42.", "42"),
    ("Final Answer: 7 since 2x = 14", "7"),
    ("The correct answer is 9 as 3^2 = 9.", "9"),
    ("The answer is: 12, because 4 * 3 = 12", "12"),
    # a conclusion word between the marker and the answer
    ("The answer is therefore 12, because 3*4 = 12.", "12"),
    ("The answer is thus 9 as 3^2 = 9", "9"),
    ("The answer is clearly 5 given that 2+3 = 5", "5"),
    ("The answer is simply 8 because 2^3 = 8", "8"),
    ("The answer is therefore: 12", "12"),
    ("The answer is equal to 12 since 3 * 4 = 12", "12"),
    ("The answer is as follows: 12 apples.", "12"),
    # justification words
    ("The answer is 12 for 4 groups of 3", "12"),
    ("The answer is 12 due to 4 groups of 3", "12"),
    ("The answer is 12, which is 4 * 3", "12"),
    ("The answer is 12 (since 3*4 = 12).", "12"),
    ("The answer is 12, hence 4 groups of 3", "12"),
    ("The answer is 12 so 3 groups of 4", "12"),
    ("The answer is 12, given 4 groups of 3", "12"),
    # prose right after the number: a colon, parentheses, "i.e.", "that is", words
    ("The answer is 12 (4 groups of 3).", "12"),
    ("The answer is 12: 4 groups of 3.", "12"),
    ("The answer is 12 (= 3 * 4).", "12"),
    ("The answer is 12, i.e. 4 times 3.", "12"),
    ("The answer is 12, e.g. 4 groups of 3.", "12"),
    ("The answer is 12, that is 4 times 3.", "12"),
    ("The answer is 12 apples because 3 bags hold 4 each", "12"),
    ("The answer is 12 in total from 4 groups of 3", "12"),
    # the number in $...$, \( \), **bold**
    ("The answer is $12$: four groups of three.", "12"),
    ("The answer is $12$ because $3 \\cdot 4 = 12$.", "12"),
    ("The answer is $12$ apples, from 4 bags of 3", "12"),
    ("The answer is **12** because 3 \u00d7 4 = 12.", "12"),
    ("The answer is **12**, since 3 * 4 = 12", "12"),
    ("The answer is **12**: four groups of three", "12"),
    ("The answer is \\(12\\) since 3*4 = 12", "12"),
    ("The answer is \\( \\frac{1}{2} \\) because half of them left", "\\frac{1}{2}"),
    # answers that are not plain integers
    ("The answer is x = 7, since 2x = 14.", "x = 7"),
    ("The answer is $x = 7$ because 2x = 14", "x = 7"),
    ("The answer is -3 because 3 - 6 = -3", "-3"),
    ("The answer is 3/4 because 6/8 = 3/4", "3/4"),
    ("The answer is 2.5 because 5/2 = 2.5.", "2.5"),
    ("The answer is 1,200 because 12 * 100 = 1200", "1,200"),
    ("The answer is \\frac{7}{2} since 3.5 = 7/2", "\\frac{7}{2}"),
    ("The answer is 2\\sqrt{3}, since \\sqrt{12} = 2\\sqrt{3}", "2\\sqrt{3}"),
    ("The answer is 4 log 2 because log 16 = 4 log 2", "4 log 2"),  # "log" is mathematics
    # answers in a notation, then a justification
    ("The answer is 3.2e5 because 320000 = 3.2 * 10^5", "3.2e5"),
    ("The answer is 3.2 \u00d7 10^5, since 320000 has 5 digits after the 3", "3.2 \u00d7 10^5"),
    ("The answer is 1.5\u00b710\u207b\u00b3 because 1.5 / 1000 = 0.0015", "1.5\u00b710^{-3}"),
    ("The answer is 0.1(6) since 1/6 = 0.1666...", "0.1(6)"),
    ("The answer is 0.\\overline{3}, as 1/3 = 0.333...", "0.\\overline{3}"),
    ("The answer is 1.2(34) because 611/495 = 1.2343434...", "1.2(34)"),
    ("The answer is 0.1666 (6 repeating) since 1/6", "0.1666 (6 repeating)"),
    # the sentence ends before a justification in the next sentence
    ("The answer is 12. Because 3*4 = 12.", "12"),
    ("The answer is 12.\nThis is because 4 groups of 3.", "12"),
    # a computation stated as the answer: its result
    ("The answer is 3 * 4 = 12 apples.", "12"),
    ("the final answer is 15 gallons * 8 pints / gallon = 120 pints", "120"),
    ("The answer is 10 - 3 = 7 because 3 were eaten", "7"),
    ("Our answer is therefore $16\\cdot (-8) = {-128}$.", "-128"),
    ("This gives us our answer: $2002-56-6={1940}$.", "1940"),
    ("The answer is 1/2 = 0.5", "0.5"),
    ("The answer is 980 cm\u00b3.", "980"),  # a unit with an exponent is still a unit
    ("We may check our answer: 3 * 4 = 12, so our answer is correct.", "12"),  # a verdict
    # only the last marker counts
    ("I first thought the answer is 10 because 5 + 5. The answer is 12 because 3*4 = 12.", "12"),
]


@pytest.mark.parametrize("text, answer", MARKER_JUSTIFIED)
def test_marker_answer_without_its_justification(text, answer):
    assert extract_answer(text) == (answer, "answer_is")


# Text after the marker that is mathematics, not a justification: kept whole.
MARKER_NOT_JUSTIFIED = [
    ("The answer is 5 - 3.", "5 - 3"),  # a hyphen before a number is a minus
    ("The answer is 2 and 3.", "2 and 3"),
    ("The answer is 3 pi.", "3 pi"),
    ("The answer is 2^{10}.", "2^{10}"),
    ("The answer is 10 choose 3.", "10 choose 3"),
    ("The answer is 2(3)", "2(3)"),  # a product, not a parenthesized reason
    ("The answer is 12 = 3 * 4", "12 = 3 * 4"),  # no operator left of "=": not a computation
    ("The answer is 2x = 14", "2x = 14"),
]


@pytest.mark.parametrize("text, answer", MARKER_NOT_JUSTIFIED)
def test_marker_answer_kept_whole(text, answer):
    assert extract_answer(text) == (answer, "answer_is")


@pytest.mark.parametrize(
    "text, answer",
    [
        ("the answer is not 5; it is 7.", "7"),  # a negated marker states nothing
        ("The answer is not 5, because 5 * 3 = 15, so it must be 7", "7"),
        ("**Answer:**\n12", "12"),  # nothing on the marker's line: the last number
        ("Let me find the answer:\nfirst 3 * 4 = 12, then 12 - 5 = 7", "7"),
        ("Answer: Let's think step by step.\n3 * 4 = 12\nSo 12 apples", "12"),  # prose
        ("The answer is that we cannot tell, so 5", "5"),
        ("So x = 12, and the answer is correct.", "12"),  # a verdict states nothing
        ("The answer: \\[\n12\n\\]", "12"),  # only a delimiter on the marker's line
    ],
)
def test_marker_that_states_nothing_falls_back(text, answer):
    assert extract_answer(text) == (answer, "last_number")


@pytest.mark.parametrize(
    "text, answer",
    [
        ("The answer is C because it is the largest", "C"),  # short answers are not prose
        ("The answer is Tuesday, since 10 days after Saturday", "Tuesday"),
        ("The answer is (B) because 3 < 4", "(B)"),
        ("Answer: \\text{Devon} because Devon finished first", "\\text{Devon}"),
    ],
)
def test_short_word_answers_are_stated(text, answer):
    assert extract_answer(text) == (answer, "answer_is")


def test_earlier_marker_used_when_the_last_is_negated():
    assert extract_answer("The answer is 7 because 14 / 2. Note the answer is not 5.") == ("7", "answer_is")


def test_stated_answer_is_the_text_after_a_marker():
    text = "So the answer is therefore **12**, because 4 * 3 = 12."
    assert stated_answer(text, text.index("therefore")) == "12"
    assert stated_answer("   ") is None
    assert stated_answer("not 5") is None


# ---------------------------------------------------------------------------------------------
# Without a marker: the last-number fallback reads the stated number
# ---------------------------------------------------------------------------------------------

LAST_NUMBER_JUSTIFIED = [
    ("x = 7, since 2x = 14", "7"),
    ("x = 7, since 2x = 14.", "7"),
    ("So x = 7 because 2 * 7 = 14.", "7"),
    ("Thus there are 12 cookies, because 4 * 3 = 12.", "12"),
    ("Therefore 12 because 4 groups of 3", "12"),
    ("We get 45 minutes, as 3 * 15 = 45", "45"),
    ("So she has 8 apples due to 2 bags of 4", "8"),
    ("x = 7, given that 2x = 14", "7"),
    ("It's 7 (since 2x = 14)", "7"),
    ("x = 7; since 2x = 14", "7"),  # semicolon, no main clause after: still a justification
    ("Step 2: x = 7 since 2x = 14", "7"),
    ("First, 2 + 2 = 4. Then x = 7, since 2x = 14.", "7"),
    ("We have 10 - 3 = 7 because 3 were eaten", "7"),
    ("The sum is 9, since a = 2, b = 3, and c = 4.", "9"),  # a list in the justification
    ("The total is $12$ because $3 \\times 4 = 12$", "12"),
    ("so 0.(3), since 3 * 0.(3) = 1", "0.(3)"),
    ("So the speed is 3.2 x 10^5 km/s because 320000 = 3.2 x 10^5", "3.2 x 10^5"),
    ("so x = 0.333... because 3x = 1", "0.333..."),
    ("We get 12. This is because 4 groups of 3.", "12"),  # a sentence that only justifies
    ("We get 12. That's because 4 groups of 3.", "12"),
    # the justification computes a number the sentence stated: that number
    ("He can spend 55 more minutes before his average goes above 60 because 300 - 245 = 55", "55"),
    ("Therefore, there are 39 rooms with 2 windows because 78/2 = 39.", "39"),
    ("He needs to read 200 more pages to reach 800 pages because 800 - 600 = 200", "200"),
    # ... and without "= N" a restated number is not the result
    ("5*3 = 15 tablespoons of soap are used, since each cup of water needs 3 tablespoons.", "15"),
    # sentences end at a period before a closing math delimiter
    ("We get $x^6 + y^6 = 13536.$ Since $0 < y^6 < 1,$ the greatest integer below $x^6$ is 13535", "13535"),
    ("So \\[x^6 + y^6 = 13536.\\]Since $0 < y^6 < 1,$ the floor of $x^6$ is $13535$", "13535"),
    ("Then, since two pairs have $a = 15,$ one has $a = 13.$ The sum is $216 + 224 = 440$", "440"),
]


@pytest.mark.parametrize("text, answer", LAST_NUMBER_JUSTIFIED)
def test_last_number_is_the_stated_one(text, answer):
    assert extract_answer(text) == (answer, "last_number")


# The justification word opens a fronted clause, or the sentence concludes after it, or the word
# is no justification: the last number is the answer.
LAST_NUMBER_NOT_JUSTIFIED = [
    ("Since 2x = 14, x = 7.", "7"),
    ("Because 3 were eaten, 7 remain.", "7"),
    ("We had 10 apples, and since 3 were eaten, 7 remain.", "7"),
    ("We had 10 apples, but because 3 were eaten, only 7 remain.", "7"),
    ("Tom had 10 apples; since 3 were eaten, 7 remain.", "7"),
    ("We had 10 apples, since 3 were eaten, 7 remain.", "7"),
    ("After 2 hours, since the speed is 30, the distance is 60.", "60"),
    ("There are 3 boxes because each holds 4, so the total is 12.", "12"),
    ("I multiplied 3 by 4 because there are 4 groups, giving 12.", "12"),
    ("He had 20 dollars because he saved 5 a week, leaving 20 - 8 = 12.", "12"),
    ("Each costs 3 because of the sale, which gives 4 * 3 = 12.", "12"),
    ("3 * 4 = 12, so 12", "12"),
    ("She has twice as many as 6, which is 12", "12"),  # bare "as" is a comparison
    ("There are 5 red ones, as well as 7 blue ones", "7"),
    ("We get 5, as expected, plus 7 more", "7"),
    ("We get 12. Because 3 were eaten, 7 remain.", "7"),  # a main clause: not only a reason
    ("Since 3 were eaten and 10 were bought, 7 remain", "7"),
    ("First 2 + 3 = 5, thus 5 * 4 = 20", "20"),
    ("I have 3 hundred-dollar bills", "3"),  # "hundred-dollar" is no magnitude
]


@pytest.mark.parametrize("text, answer", LAST_NUMBER_NOT_JUSTIFIED)
def test_last_number_is_the_last_one(text, answer):
    assert extract_answer(text) == (answer, "last_number")


# ---------------------------------------------------------------------------------------------
# Grading: (model output, gold, reward). Near misses name a number of the justification.
# ---------------------------------------------------------------------------------------------

JUSTIFIED_GRADES = [
    ("**Answer:** 12 \u2014 from 4 groups of 3", "12", 1),
    ("**Answer:** 12 \u2014 from 4 groups of 3", "3", 0),
    ("**Answer:** 12 \u2014 from 4 groups of 3", "4", 0),
    ("x = 7, since 2x = 14", "7", 1),
    ("x = 7, since 2x = 14", "14", 0),
    ("x = 7, since 2x = 14", "2", 0),
    ("The answer is 12 because 3*4 = 12", "12", 1),
    ("The answer is 12 because 3*4 = 12", "3", 0),
    ("The answer is 12 for 4 groups of 3", "12", 1),
    ("The answer is 12 for 4 groups of 3", "3", 0),
    ("My answer is 20 because 4 * 5 = 20", "20", 1),
    ("My answer is 20 because 4 * 5 = 20", "5", 0),
    ("The answer is 7, since 10 - 3 = 7", "3", 0),
    ("The answer is $12$: four groups of three.", "12", 1),
    ("The answer is $12$: four groups of three.", "4", 0),
    ("The answer is therefore 12, because 3 * 4", "12", 1),
    ("The answer is therefore 12, because 3 * 4", "4", 0),
    ("Answer: 12 -- from 4 groups of 3", "3", 0),
    ("The answer is 12 (4 groups of 3).", "3", 0),
    ("The answer is 12, i.e. 4 times 3.", "3", 0),
    ("The answer is 12 apples because 3 bags hold 4 each", "12", 1),
    ("The answer is 12 apples because 3 bags hold 4 each", "4", 0),
    ("The answer is -3 because 3 - 6 = -3", "-3", 1),
    ("The answer is -3 because 3 - 6 = -3", "3", 0),
    ("The answer is $x = 7$ because 2x = 14", "7", 1),
    ("The answer is $x = 7$ because 2x = 14", "14", 0),
    ("The answer is \\frac{7}{2} since 3.5 = 7/2", "3.5", 1),
    ("The answer is \\frac{7}{2} since 3.5 = 7/2", "2", 0),
    ("The answer is 3.2e5 because 320000 = 3.2 * 10^5", "320000", 1),
    ("The answer is 3.2e5 because 320000 = 3.2 * 10^5", "3.2", 0),
    ("The answer is 0.1(6) since 1/6 = 0.1666...", "\\frac{1}{6}", 1),
    ("The answer is 0.1(6) since 1/6 = 0.1666...", "6", 0),
    ("So the speed is 3.2 x 10^5 km/s because 320000 = 3.2 x 10^5", "320000", 1),
    ("So the speed is 3.2 x 10^5 km/s because 320000 = 3.2 x 10^5", "5", 0),
    ("Thus there are 12 cookies, because 4 * 3 = 12.", "12", 1),
    ("So she has 8 apples due to 2 bags of 4", "8", 1),
    ("So she has 8 apples due to 2 bags of 4", "4", 0),
    ("We get 12. This is because 4 groups of 3.", "12", 1),
    ("We get 12. This is because 4 groups of 3.", "3", 0),
    # the last number wins where the justification word is not one
    ("There are 3 boxes because each holds 4, so the total is 12.", "12", 1),
    ("There are 3 boxes because each holds 4, so the total is 12.", "3", 0),
    ("We had 10 apples, and since 3 were eaten, 7 remain.", "7", 1),
    ("We had 10 apples, and since 3 were eaten, 7 remain.", "10", 0),
    ("the answer is not 5; it is 7.", "7", 1),
    ("the answer is not 5; it is 7.", "5", 0),
    ("The answer is 3 * 4 = 12 apples.", "12", 1),
    ("The answer is 3 * 4 = 12 apples.", "3", 0),
    ("He can spend 55 more minutes before his average goes above 60 because 300 - 245 = 55", "55", 1),
    ("He can spend 55 more minutes before his average goes above 60 because 300 - 245 = 55", "60", 0),
]


@pytest.mark.parametrize("output, gold, expected", JUSTIFIED_GRADES)
def test_justified_grading(output, gold, expected):
    score = grade(output, gold)
    assert score.reward == expected, score.info
    if expected == 0:
        assert score.info["reason"] == "wrong"


@pytest.mark.parametrize(
    "raw, stripped",
    [
        ("3 dozen", "3"),  # a unit like any other word
        ("4 log 2", "4 log 2"),  # mathematics is kept
        ("2 cos x", "2 cos x"),
        ("5 meters per second", "5"),
        ("5 cm. long", "5"),
    ],
)
def test_strip_units_words(raw, stripped):
    assert strip_units(raw) == stripped


# ---------------------------------------------------------------------------------------------
# Extraction time is linear: adversarial texts return fast
# ---------------------------------------------------------------------------------------------

N = 50_000
ADVERSARIAL = {
    "spaces after the marker": "The answer is 1" + " " * N + "x",
    "spaces after answer": "the answer" + " " * N + "x",
    "spaces in \\( \\)": "The answer is \\( " + " " * N + "x",
    "spaces in a notation": "The answer is 1" + " " * N + "x" + " " * N + "10" + " " * N + "^",
    "many markers": "the answer is not " * (N // 18),
    "many justifications": "x = 7 because " * (N // 14),
    "fronted justifications": "1 and because " * (N // 14) + "2",
    "semicolon justifications": "1; since , " * (N // 11) + "2",
    "many commas": "1 because " + "a, b" * (N // 4) + " 2",
    "unclosed boxes": "\\boxed{" * (N // 7),
    "long digit run": "The answer is " + "1" * N + " because",
    "long decimal": "The answer is 0." + "12" * (N // 2) + "3...",
    "long unit words": "The answer is 5 " + "ab " * (N // 3) + "!",
    "long letter run": "The answer is 5 " + "a" * N + "!",
    "many numbers": "1 " * (N // 2),
    "many superscripts": "10" + "\u00b2" * N,
    "degrees": "\\boxed{5^ " + " " * N + "}",
    "long computation": "The answer is 1 + " + "1 = " * (N // 4),
    "nested brackets": "The answer is 1 + " + "(" * N + " = 2",
    "math-delimited sentences": "x = 1.$ since 2, " * (N // 16) + "3",
    "many exponents": "x^{2} " * (N // 6),
    "delimiters only": "Answer: " + "\\[ $ " * (N // 5),
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_extraction_is_fast_on_adversarial_text(name):
    from marft_jax.envs.math_grading import normalize_answer, numeric_equal, rewrite_notation

    text = ADVERSARIAL[name]

    def cpu_seconds() -> float:
        start = time.process_time()
        answer, _ = extract_answer(text)
        if answer is not None:  # the steps grade() runs before the worker
            strip_units(answer)
            normalize_answer(rewrite_notation(answer))
            numeric_equal(answer, "1")
        return time.process_time() - start

    # this process's CPU time, best of two: a stall of a loaded CI box once took one call 7.7 s of
    # wall time (0.03 s alone); a quadratic pass would take minutes every time
    assert min(cpu_seconds(), cpu_seconds()) < 2.0  # linear: ~0.1 s
