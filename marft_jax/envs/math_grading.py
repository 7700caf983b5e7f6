"""Math answer grading: extract the model's final answer and decide equivalence with the gold.

Overview: docs/tasks.md#math-benchmarks-and-grading.

Extraction (:func:`extract_answer`), in order, after Unicode math is spelled out
(:func:`plain_math_text`: ``−``, ``10⁻³``, ``0.3̅``):
  1. the final box (:func:`final_boxed`): the content of the last brace-balanced ``\\boxed{...}``
     / ``\\fbox{...}`` (``\\boxed 5`` without braces takes the next whitespace-delimited
     token; an unclosed one is skipped). An empty last box means no answer, even after an earlier
     box (the response retracted it). Boxes joined to the last one by a connective only, in
     one paragraph ("x = \\boxed{2} or x = \\boxed{-5}", "$\\boxed{3}$ and $\\boxed{4}$",
     "\\boxed{2}, \\boxed{-5}") state one answer: their contents joined, "2, -5" (a set for
     math-verify); after any other word ("then corrected:") the later box replaces the earlier;
  2. the answer stated after the last "answer is" / "answer:" marker ("The answer is", "final
     answer:", "My answer is", "**Answer:**"), to the end of the sentence (:func:`stated_answer`):
     after a conclusion word ("is therefore 12"), cut before a justification ("12 because 4
     groups of 3" -> "12"; also since, as, due to, given, which, so, hence, thus, therefore,
     for, an em dash, `` -- ``) and after a leading number followed by prose ("12: four groups
     of 3", "12 (4 x 3)", "12, i.e. ...", "$12$ apples" -> "12"); an ellipsis right after
     decimal digits ("0.333...") belongs to the number, not to the sentence. A marker that
     states nothing (negated: "not 5"; prose: "Let's think step by step") defers to the one
     before, then to step 3;
  3. the last number in the text (``last_number_fallback``, default on), with the notations
     below taken whole ("3 x 10^8", "0.(3)", "10^{-3}"); but when its sentence states a number
     and then justifies it ("x = 7, since 2x = 14"), the stated number (:func:`stated_number`).
All of it runs in linear time in the response (no regex can backtrack quadratically), since it
runs in the caller's process, outside the worker's hard time limit.

Equivalence (:func:`grade`), first decisive step wins; ``info["method"]`` names it:
  ``"exact"``       the normalized strings are identical (cheap shortcut, always sound);
  ``"integer"``     both sides are plain integers (decided exactly, no sympy needed);
  ``"math_verify"`` ``math_verify.parse`` on both sides (gold wrapped in ``\\boxed{}``) then
                    ``math_verify.verify``, run in a killable worker process with a hard
                    per-item time limit (:class:`VerifyWorker`);
  ``"numeric"``     only when math-verify timed out, crashed or could not parse: both sides
                    parse as numbers and agree: exactly for an exact gold, within relative
                    tolerance 1e-4 for a decimal gold.
When math-verify fails and the numeric fallback does not apply, the reward is 0 and
``info["reason"]`` is ``"timeout"`` / ``"verify_error"`` (``info["method"] == "fallback"``).

What counts as equal (issue 38, as a careful human MATH grader decides):
  * an exact gold (no decimal number in it: integers, fractions, radicals, ``\\pi``, ``e``,
    expressions) needs an exactly equal answer: a decimal in the response is the exact fraction
    it writes (``0.5`` = 1/2 matches, ``0.3333333333`` does not match 1/3, nor ``2.7182818`` nor
    ``(1+1/1000)^{1000}`` e). Only a decimal gold (``0.25``, ``3.14``) allows a close value:
    both sides agree when rounded to 6 decimal places (math-verify's rule; relative 1e-4 in the
    numeric fallback). See :func:`math_verify_equal` and :func:`is_decimal_gold`.
  * a percent gold (``25\\%``) asks for a percentage: a response without the sign is read in
    percent (``25`` matches, ``0.25`` does not); see :func:`percent_gold`.
  * an inequality and an interval are the same answer when they denote the same set of reals
    (``x > 2`` = ``(2, \\infty)``, ``x \\le -1 \\text{ or } x > 2`` =
    ``(-\\infty, -1] \\cup (2, \\infty)``); see :func:`_inequality_set`.
  * a plain-text mixed number is its sum: ``2 1/2`` = 5/2 (:func:`rewrite_mixed_numbers`).

Before comparing, both sides written in a plain-text number notation are rewritten to their
exact value (:func:`rewrite_notation`; rules in :func:`notation_value`): scientific notation
(``1.5e3``, ``3.2E+05``, ``1.5 x 10^3``, ``3.2*10**5``, ``1.5 \\times 10^{3}``, ``1.5·10⁻³``)
and repeating decimals (``0.(3)``, ``1.2(34)``, ``0.1\\overline{6}``,
``0.\\dot{3}``, ``0.3̅``, ``0.3 repeating``, ``0.1 with 6 repeating``, and ``0.333...`` only when
a digit block is visibly repeated before the ellipsis), and mixed numbers (``2 1/2``,
``2\\frac{1}{2}``). Plain decimals are never read as repeating: ``0.33``, ``0.3333`` and
``0.333333`` differ from 1/3.

Gold answers are used as given (never last-number extracted: ``\\frac{14}{3}`` stays 14/3);
GSM8K worked solutions go through :func:`gsm8k_final_answer` first.
"""

from __future__ import annotations

import atexit
import bisect
import fractions
import importlib
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from typing import Any

from marft_jax.envs.parent_watch import exit_when_orphaned
from marft_jax.envs.task import Score

DEFAULT_TIMEOUT_S = 5.0
NUMERIC_REL_TOL = 1e-4
DEFAULT_VERIFY_FN = "marft_jax.envs.math_grading:math_verify_equal"
# Exact values of number notations are only built for moderate sizes: "1e999999" would make a
# million-digit integer (slow to build, too long to print for math-verify). Larger ones are left
# as written, for math-verify under the worker's hard time limit.
MAX_EXPONENT = 400
MAX_NOTATION_DIGITS = 200

# ----------------------------------------------------------------------------------------------
# Extraction
# ----------------------------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# Every regex below is linear in its input: each ``\s*`` follows a fixed token, so a long run of
# spaces, digits or markers cannot make the engine try quadratically many splits (the text is
# read in the trainer's process, outside the worker's time limit).

# "the answer is", "final answer:", "My answer is", "**Answer:**", "Answer: 12".
_ANSWER_IS_RE = re.compile(r"\banswer(?:\s*(?:\*\*|__))?\s*(?:is\b|:)(?:\s*:)?", re.IGNORECASE)
# The end of the stated answer's sentence (group "end"): a period before a space or the end, or
# a newline. An ellipsis after decimal digits ("0.333...") belongs to the number and the periods
# of "i.e." / "e.g." to the sentence, so they are matched (and skipped) first.
_SENTENCE_END_RE = re.compile(r"(?<=\d\.)\d+\.\.\.|\b[ie]\.[eg]\.|(?P<end>\.(?=\s|$)|\n)", re.IGNORECASE)
# A justification after the stated answer: "12 because 3 * 4 = 12", "7, since 10 - 3 = 7",
# "12 for 4 groups of 3", "12 \u2014 from 4 groups of 3", "12 -- 3*4", "12 \u2013 from ...".
_JUSTIFICATION_RE = re.compile(
    r"(?:[,;]\s*)?(?:\(\s*)?\b(?:because|since|as|due to|given|which|so|hence|thus|therefore|for)\b"
    r"|\u2014|\s(?:\u2013|--)\s",
    re.IGNORECASE,
)
# Words between "the answer is" and the answer: "the answer is therefore 12", "... is: just 12".
_LEADING_ADVERB_RE = re.compile(
    r"(?:therefore|thus|hence|then|clearly|simply|just|indeed|actually|exactly|equal to|as follows)\b[\s,:]*",
    re.IGNORECASE,
)
# "the answer is not 5", "our answer is correct": a marker that does not state the answer.
_NEGATED_RE = re.compile(r"not\b", re.IGNORECASE)
_VERDICT_RE = re.compile(
    r"(?:correct|incorrect|right|wrong|reasonable|valid|invalid|consistent|confirmed|verified|checked)\W*",
    re.IGNORECASE,
)
# Only delimiters: "Answer: \[" with the mathematics on the next lines.
_DELIMITERS_RE = re.compile(r"(?:\\[\[(]|\$|[\s:*_])*")
# "Answer: Let's think step by step": prose (no digit, no mathematics, four or more words) states
# no answer either; a one-word or short answer ("C", "Tuesday", "(B)") does.
_MATH_CHAR_RE = re.compile(r"[\d\\$^=()\[\]{}+*/<>|_]")
# Without an "answer is" marker, a justification is only a word that looks back at what was
# stated ("so" and "hence" introduce conclusions there): "x = 7, since 2x = 14".
_BACKWARD_RE = re.compile(
    r"\b(?:because|since|due to|given that)\b"
    r"|,\s*as\b(?!\s+(?:well|a result|follows|such|shown|expected|before|above|required|needed)\b)",
    re.IGNORECASE,
)
# A justification word right after one of these starts a fronted clause, not a justification:
# "we had 10, and since 3 were eaten, 7 remain"; after a semicolon only when a comma follows
# ("10 apples; since 3 were eaten, 7 remain", but "x = 7; since 2x = 14" justifies 7).
_FRONTED_RE = re.compile(
    r"(?:\b(?:and|but|or|so|then|thus|hence|therefore|now|next|finally|also|while)\b|(?P<semi>;))[\s,]*$",
    re.IGNORECASE,
)
# A conclusion after a justification: the sentence goes on to state its result, which is then
# the last number ("3 boxes because each holds 4, so the total is 12").
_CONCLUSION_RE = re.compile(
    r"\b(?:so|thus|hence|therefore|consequently|giving|leaving|yielding|resulting in|for a total of"
    r"|which (?:gives|means|makes|leaves)|this gives|that gives)\b",
    re.IGNORECASE,
)
# After a justification, a comma then a main clause (not "and", "or", "which"...): the
# justification was fronted ("After 2 hours, since the speed is 30, the distance is 60").
_MAIN_CLAUSE_RE = re.compile(
    r",(?:\$|\\\))?\s+(?!(?:and|or|but|which|where|so|as|because|since)\b|i\.e\.|e\.g\.|that is\b)",
    re.IGNORECASE,
)
# A justification that ends on a computed result: "... because 300 - 245 = 55" (then at last.start()).
_RESULT_GAP_RE = re.compile(r"=\s*\$?\s*$")
# What may stand between a stated number and its justification: "7, since", "7 (because", "$7$ as".
_DIRECT_GAP_RE = re.compile(r"[\s,;(*$]*")
# A sentence that only justifies the one before: "This is because 4 groups of 3."
_JUSTIFICATION_SENTENCE_RE = re.compile(
    r"\s*(?:(?:this|that|it)\s+is\s+|that's\s+|it's\s+)?because\b", re.IGNORECASE
)
# Sentence or clause starts (group "end") for the last-number fallback ("Step 2: since ...";
# a period before a closing math delimiter, "$a = 13.$ Then", "= 13536.\]Since", ends one too);
# an ellipsis after decimals and "i.e." / "e.g." are skipped as in _SENTENCE_END_RE.
_CLAUSE_START_RE = re.compile(
    r"(?<=\d\.)\d+\.\.\.|\b[ie]\.[eg]\.|(?P<end>[.!?](?=\s)|[.!?](?:\$\$?|\\[)\]])|\n|:\s)", re.IGNORECASE
)

# Plain-text number notations (shared by last_number and notation_value).
_TIMES = r"(?:[xX\u00d7*\u00b7\u22c5\u2219]|\\times|\\cdot)"


def _pow10(exponent: str) -> str:
    """``10^n``, ``10^{n}``, ``10^(n)`` or ``10**n`` with ``n`` matching ``exponent``."""
    return rf"10\s*(?:\^|\*\*)\s*(?:\{{\s*{exponent}\s*\}}|\(\s*{exponent}\s*\)|{exponent})"


_INT = r"[-+]?\d+"
_POW10_ANY = _pow10(_INT)
_SCI_TAIL = rf"(?:[eE]{_INT}(?!\w|\.\d)|\s*{_TIMES}\s*{_POW10_ANY})"
_ELLIPSIS = r"(?:\.\.\.|\u2026|\\[lc]?dots)"
_REPEAT_VERB = r"(?:repeating|recurring|repeated|repeats|recurs)"
_REPEAT_WORD = rf"\(?{_REPEAT_VERB}\)?"
# "0.1 with 6 repeating", "0.16 with the 6 repeating", "0.1666 (6 repeating)"
_REPEAT_PHRASE = (
    rf"(?:,?\s*with\s+(?:the\s+)?(?P<rep>\d+)(?:'?s)?\s+{_REPEAT_VERB}"
    rf"|\s*\(\s*(?P<rep2>\d+)(?:'?s)?\s+{_REPEAT_VERB}\s*\))"
)
_DOT = r"\\dot\s*\{?\d\}?"
_MARKED_REPETEND = (
    rf"(?:\(\d+\)|\[\d+\]|\\(?:overline|bar)\s*(?:\{{\d+\}}|\d)|{_DOT}(?:\d*{_DOT})?)"
)
_NOTATION_NUMBER = (
    rf"-?(?:\d+(?:\.\d*)?|\.\d+){_SCI_TAIL}"
    rf"|-?\d*\.\d+{re.sub(r'[?]P<rep2?>', '?:', _REPEAT_PHRASE)}"
    rf"|-?\d*\.\d+(?:\s*{_ELLIPSIS}|\s+{_REPEAT_WORD})"
    rf"|-?(?:\d+\.\d*|\.\d*){_MARKED_REPETEND}"
    # a bare power, read whole: "10^{-3}" (also "10⁻³" once spelled out), "2^10"
    r"|-?\d+(?:\.\d+)?\^(?:\{\s*-?\d+\s*\}|-?\d+)"
)
# Not inside a word or after a closing bracket, and not an exponent or subscript ("cm^{3}", "x^2",
# "a_{1}"): those are never the answer alone.
_NOT_AFTER = r"(?<![\w)\]}.^])(?<!\^\{)(?<!_\{)(?<!\^\()"
# A plain-text mixed number, "2 1/2" (= 5/2; rewritten by rewrite_mixed_numbers): whole part,
# spaces (not a newline), a fraction; not inside a word, an exponent or a longer fraction.
_MIXED = r"\d+[ \t]+\d+/\d+(?![\w/^(]|\.\d)"
_NUMBER_RE = re.compile(
    rf"{_NOT_AFTER}(?:{_NOTATION_NUMBER})"
    rf"|{_NOT_AFTER}-?{_MIXED}"
    rf"|{_NOT_AFTER}-?\d+(?:,\d{{3}})*(?:\.\d+)?(?:/\d+)?|{_NOT_AFTER}-?\.\d+",
    re.IGNORECASE,
)

# Unicode spellings of plain-text math: the minus sign (and an en dash or figure dash written as
# one: "\u20135"), superscript exponents ("10\u2075", "x\u00b2") and digits under a combining
# overline or macron ("0.3\u0305", "0.1\u03056\u0305").
_SUPERSCRIPTS = str.maketrans(
    "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207b\u207a", "0123456789-+"
)
_SUPERSCRIPT_RE = re.compile("[\u2070\u00b9\u00b2\u00b3\u2074-\u2079\u207b\u207a]+")
_COMBINING_BAR_RE = re.compile("(?:[0-9][\u0305\u0304])+")
_DASH_MINUS_RE = re.compile(r"(?<![\w.)\]}])[\u2012\u2013](?=[\d.])")


def plain_math_text(text: str) -> str:
    """``text`` with Unicode math spelled in ASCII/LaTeX: ``\u2212`` -> ``-``, ``10\u207b\u00b3`` ->
    ``10^{-3}``, ``0.1\u0305 6\u0305`` (combining overlines) -> ``0.\\overline{16}``; an en dash
    right before a number and not after one (``\u20135``, not the range ``2\u20135``) -> ``-``.
    Idempotent; linear time."""
    text = _DASH_MINUS_RE.sub("-", text.replace("\u2212", "-"))
    text = _SUPERSCRIPT_RE.sub(lambda m: "^{" + m.group(0).translate(_SUPERSCRIPTS) + "}", text)
    return _COMBINING_BAR_RE.sub(lambda m: "\\overline{" + m.group(0)[::2] + "}", text)


def _brace_pairs(text: str) -> dict[int, int]:
    """Index of each ``{`` -> index of its matching ``}`` (unclosed ones absent), in one pass.

    Escaped braces (``\\{``, ``\\}``) are skipped so ``\\boxed{\\{1,2\\}}`` reads ``\\{1,2\\}``.
    """
    stack: list[int] = []
    pairs: dict[int, int] = {}
    for m in re.finditer(r"\\.|[{}]", text, re.DOTALL):
        if m.group(0) == "{":
            stack.append(m.start())
        elif m.group(0) == "}" and stack:
            pairs[stack.pop()] = m.start()
    return pairs


def _boxes(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, content)`` of each well-formed ``\\boxed``/``\\fbox`` in text order.

    ``content`` is stripped and may be empty (``\\boxed{}``); a box left unclosed (e.g. a
    truncated response) is not listed. ``\\boxed 5`` without braces takes the next
    whitespace-delimited token. Linear in ``text`` (braces are matched once for all boxes).
    """
    pairs: dict[int, int] | None = None
    boxes = []
    for match in _BOX_RE.finditer(text):
        i = match.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == "{":
            pairs = _brace_pairs(text) if pairs is None else pairs
            if i in pairs:
                boxes.append((match.start(), pairs[i] + 1, text[i + 1 : pairs[i]].strip()))
        else:  # "\boxed 5": the next whitespace-delimited token
            token = re.compile(r"[^\s$]+").match(text, i)
            if token:
                boxes.append((match.start(), token.end(), token.group(0).rstrip(".,;").strip()))
    return boxes


def last_boxed(text: str) -> str | None:
    """Content of the last well-formed, non-empty ``\\boxed``/``\\fbox`` in ``text`` (stripped),
    or None. Gold solutions are read with it; responses with :func:`final_boxed`.

    A box left unclosed (e.g. a truncated response) is skipped in favour of an earlier one.
    """
    for _, _, content in reversed(_boxes(text)):
        if content:
            return content
    return None


# What may stand between two boxes that state one answer together: delimiters, then a
# connective (",", ";", "or", "and", "\text{ or }", "\lor", a LaTeX line break "\\\\"), then
# optionally the next variable ("x =", "x_2 =", "y &="): "x = \boxed{2} or x = \boxed{-5}",
# "$\boxed{2}$ and $\boxed{-5}$", "\boxed{2}, \boxed{-5}". Any other word ("then corrected:",
# "was wrong; correct is", "or rather", "i.e.") makes the later box a replacement.
_BOX_DELIM = r"(?:\s|\$|\\[()\[\]]|\\[,;:! ]|\\q?quad(?![A-Za-z])|&)"
_BOX_CONNECTIVE = (
    r"(?:[,;]|\\\\|\b(?:or|and)\b|\\(?:text|mbox|textrm|mathrm)\s*\{\s*(?:,|or|and)?\s*\}"
    r"|\\(?:lor|vee|land|wedge)(?![A-Za-z]))"
)
_BOX_VARIABLE = r"(?:[A-Za-z](?:_\{?\w+\}?)?\s*&?\s*=)"
_BOX_GAP_RE = re.compile(
    rf"{_BOX_DELIM}*(?:{_BOX_CONNECTIVE}{_BOX_DELIM}*)+(?:{_BOX_VARIABLE}{_BOX_DELIM}*)?", re.IGNORECASE
)
_MAX_BOX_GAP = 60
_PARAGRAPH_BREAK_RE = re.compile(r"\n[ \t]*\n")


def final_boxed(text: str) -> str | None:
    """The final boxed answer of a response, or None if it has no well-formed box.

    The last well-formed box is the final answer, even when it is empty: ``""`` then (a response
    that retracts its box and ends on ``\\boxed{}`` states no answer). Boxes joined to it by a
    connective only (:data:`_BOX_GAP_RE`: ``"x = \\boxed{2} or x = \\boxed{-5}"``,
    ``"\\boxed{2}, \\boxed{-5}"``) state it together: their non-empty contents in text order,
    repeats dropped, joined by ``", "`` (``"2, -5"``), which math-verify reads as a set. A box
    after other words replaces the earlier one (``"\\boxed{1}, then corrected: \\boxed{2}"`` -> ``"2"``).
    """
    boxes = _boxes(text)
    if not boxes:
        return None
    if not normalize_answer(boxes[-1][2]):  # "\boxed{}", "\boxed{ }", "\boxed{\text{}}"
        return ""
    group = [boxes[-1]]  # last first
    for box in reversed(boxes[:-1]):
        start, end = box[1], group[-1][0]
        if not 0 <= end - start <= _MAX_BOX_GAP or not _BOX_GAP_RE.fullmatch(text, start, end):
            break
        if _PARAGRAPH_BREAK_RE.search(text, start, end):
            break  # the boxes of one answer stand in one paragraph
        group.append(box)
    contents: list[str] = []
    seen: set[str] = set()
    for _, _, content in reversed(group):
        key = normalize_answer(content)
        if key and key not in seen:
            seen.add(key)
            contents.append(content)
    return ", ".join(contents)


# How many "answer is" markers are tried, last first, when the later ones state nothing
# ("the answer is not 5", "the answer is as follows:").
_MAX_MARKERS = 4


def _answer_is(text: str) -> str | None:
    """The answer stated after the last "answer is" / "answer:" marker (:func:`stated_answer`);
    a marker that states nothing (negated, or an empty sentence) defers to the one before."""
    markers = list(_ANSWER_IS_RE.finditer(text))
    for match in reversed(markers[-_MAX_MARKERS:]):
        candidate = stated_answer(text, match.end())
        if candidate is not None:
            return candidate
    return None


def stated_answer(text: str, start: int = 0) -> str | None:
    """The answer stated in ``text[start:]`` (the text after an "answer is" marker).

    Up to the end of the sentence (:data:`_SENTENCE_END_RE`), after a conclusion word
    ("therefore 12", "just 12"), cut before a justification (:func:`_drop_justification`:
    "12 because 3 * 4 = 12" -> "12") and after a leading number or ``$...$`` followed by prose
    (:func:`_cut_after_number`: "12: four groups of 3" -> "12"), without ``$``, ``**`` or
    ``\\( \\)`` around it. None if nothing is stated, the statement is negated ("not 5") or a
    verdict ("correct"), only a delimiter ("\\["), or prose of four or more words without a
    digit or mathematics ("Let's think step by step").
    """
    while start < len(text) and text[start] in " \t*_":
        start += 1
    end = len(text)
    for m in _SENTENCE_END_RE.finditer(text, start):
        if m.group("end") is not None:
            end = m.start()
            break
    candidate = text[start:end].strip().strip("*_").strip()
    adverb = _LEADING_ADVERB_RE.match(candidate)
    if adverb:
        candidate = candidate[adverb.end() :].strip().strip("*_").strip()
    if _NEGATED_RE.match(candidate):
        return None
    candidate = _cut_after_number(_computed_result(_drop_justification(candidate)))
    if not _MATH_CHAR_RE.search(candidate) and len(candidate.split()) > 3:
        return None
    if _VERDICT_RE.fullmatch(candidate) or _DELIMITERS_RE.fullmatch(candidate):
        return None
    candidate = candidate.strip().strip("*").strip().strip("$").strip()
    for left, right in (("\\(", "\\)"), ("\\[", "\\]")):  # "\( 12 \)"
        if candidate.startswith(left) and candidate.endswith(right) and len(candidate) >= 4:
            candidate = candidate[2:-2].strip()
    if not re.search(rf"\d\.\d+\s*{_ELLIPSIS}$", candidate):
        candidate = candidate.rstrip(".").strip()
    return candidate or None


def _drop_justification(candidate: str) -> str:
    """Cut a stated answer at the first justification word: ``"12 because 4 groups of 3"`` -> ``"12"``.

    Left unchanged when nothing precedes the word (``"as follows: 12"``).
    """
    match = _JUSTIFICATION_RE.search(candidate)
    if match is None or not candidate[: match.start()].strip(" \t*$,;("):
        return candidate
    return candidate[: match.start()]


def _computed_result(candidate: str) -> str:
    """A stated computation that opens with a number is its result: ``"3 * 4 = 12 apples"`` ->
    ``"12 apples"``, ``"15 gallons * 8 pints / gallon = 120 pints"`` -> ``"120 pints"``.

    Only when the left of the first ``=`` holds an operator (``* / + ×``, `` - ``, `` x ``,
    ``times``, ``\\times``, ``\\cdot``) and the ``=`` is outside brackets, and a number follows
    the last ``=`` (``"$16 \\cdot (-8) = {-128}$"`` -> ``"-128"``):
    ``"12 = 3 * 4"``, ``"12 (= 3 * 4)"``, ``"x = 7"`` and ``"\\frac{a}{b} = 2"`` are unchanged.
    """
    s = candidate.strip()
    if s.startswith("$") and s.endswith("$"):
        s = s.strip("$").strip()
    first_eq = s.find("=")
    if first_eq <= 0 or _NUMBER_RE.match(s) is None:
        return candidate
    lhs = s[:first_eq]
    depth = 0
    for ch in lhs:
        depth += (ch in "([{") - (ch in ")]}")
    if depth != 0 or not _OPERATOR_RE.search(lhs):
        return candidate  # "12 (= 3 * 4)": the "=" is inside brackets
    rhs = s[s.rfind("=") + 1 :].strip()
    if rhs.startswith("{") and rhs.endswith("}") and "{" not in rhs[1:-1]:
        rhs = rhs[1:-1].strip()  # "= {-128}"
    return rhs if _NUMBER_RE.match(rhs) else candidate


_OPERATOR_RE = re.compile(
    r"[*/+\u00d7\u00b7\u22c5]|\s[-x\u2013]\s|[\d)}]-[\d(]|\btimes\b|\\(?:times|cdot|div)\b"
)


def _prose_word(text: str) -> bool:
    """Whether ``text`` holds a word of prose: two or more letters, not a LaTeX command, not
    mathematics (``and``, ``pi``, ``times``, ``log``...) and not a repeating-decimal word."""
    for word in re.findall(r"(?<![\\A-Za-z])[A-Za-z]{2,}(?![A-Za-z])", text):
        if word.lower() not in _NOT_UNITS and not re.fullmatch(_REPEAT_VERB, word, re.IGNORECASE):
            return True
    return False


_MATH_SEGMENT_RE = re.compile(r"\$([^$]+)\$|\\\((.+?)\\\)")


def _cut_after_number(candidate: str) -> str:
    """A stated answer that opens with a number (or a ``$...$`` / ``\\(...\\)`` segment), then
    prose, is that number.

    ``"12: 4 groups of 3"``, ``"12 (4 groups of 3)"``, ``"12, i.e. 4 times 3"``, ``"12 -- 3*4"``,
    ``"12 - from 4 groups"``, ``"$12$: four threes"``, ``"**12** apples"`` -> ``"12"``. The number
    is read whole in every notation (``"1.5 x 10^3 (m)"`` -> ``"1.5 x 10^3"``; ``"0.1666 (6
    repeating)"`` is one number). Mathematics after the number is kept: ``"2 and 3"``,
    ``"3 pi"``, ``"4 log 2"``, ``"2^{10}"``, ``"5 x"``, ``"5 - 3"``, ``"$2$ and $3$"``.
    """
    m = _NUMBER_RE.match(candidate)
    if m is not None:
        head = m.group(0)
    else:
        m = _MATH_SEGMENT_RE.match(candidate)
        if m is None:
            return candidate
        head = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
    rest = candidate[m.end() :].lstrip("*_")
    if not rest.strip(" ."):
        return head
    word = re.match(r",?\s+([A-Za-z]+)(?![\w{(])", rest)  # "12 for ...", "12 cm^{3}"
    cut = (
        re.match(r"\s*(?:\u2014|--)", rest)
        or (re.match(r"\s+[-\u2013]\s", rest) and _prose_word(rest))
        or re.match(r",?\s*(?:i\.e\.|e\.g\.|that is\b)", rest, re.IGNORECASE)
        or (re.match(r"\s*(?::\s|\()", rest) and (_prose_word(rest) or "=" in rest))
        or (word is not None and _prose_word(word.group(1)))
    )
    return head if cut else candidate


def last_number(text: str) -> str | None:
    """The last number in ``text``, thousands separators removed; but when the sentence holding
    it states a number and then justifies it, the stated number.

    Numbers: int, decimal or ``a/b``, the plain-text notations of :func:`notation_value`
    (``1.5 x 10^3``, ``2.5e-4``, ``0.(3)``, ``0.333...``) and bare powers (``10^{-3}``) taken
    whole; an exponent alone (the 3 of ``cm^{3}``, the 2 of ``x^2``) is not a number.
    Justification (see :func:`stated_number`): ``"x = 7, since 2x = 14"`` -> ``"7"``.
    """
    numbers = list(_NUMBER_RE.finditer(text))
    if not numbers:
        return None
    return stated_number(text, numbers).group(0).replace(",", "")


def stated_number(text: str, numbers: list[re.Match], _depth: int = 0) -> re.Match:
    """The number a response ends on: the last one, unless its sentence (or clause after a
    colon) reads "N <justification> ...", where the justification is ``because``, ``since``,
    ``due to``, ``given that`` or ``, as``: then the last number before that word.

    A justification word is skipped (it opens a fronted clause, or the sentence goes on) when:
      * no number precedes it in the sentence (``"Since 3 were eaten, 7 remain"``);
      * it follows ``and``/``but``/``so``/``then``/... (``"10 apples, and since 3 were eaten,
        7 remain"``), or a semicolon with a comma later (``"10 apples; since 3 were eaten, 7
        remain"``; but ``"x = 7; since 2x = 14"`` justifies 7);
      * the number before it is not right before it and a main clause follows the justification
        after a comma (``"After 2 hours, since the speed is 30, the distance is 60"``; but
        ``"The sum is 9, since a = 2, b = 3, and c = 4"`` justifies 9);
      * a conclusion follows it in the sentence (``so``, ``thus``, ``giving``, ``which
        gives``...: ``"3 boxes because each holds 4, so the total is 12"`` ends on 12).
    When the justification ends on ``= R`` and the sentence also stated R before the word,
    R is the answer (``"He can spend 55 more minutes before his average goes above 60
    because 300 - 245 = 55"`` -> 55, not 60).
    ``so``, ``hence``, ``which`` and bare ``as`` are not justifications here (``"3 * 4 = 12, so
    12"``, ``"twice as many as 6"``). A last sentence that is only a justification (``"We get
    12. This is because 4 groups of 3."``) defers to the number the sentence before ends on.
    """
    last = numbers[-1]
    start = 0
    for boundary in _CLAUSE_START_RE.finditer(text, 0, last.start()):
        if boundary.group("end") is not None:
            start = boundary.end()
    conclusions = [m.start() for m in _CONCLUSION_RE.finditer(text, start, last.start())]
    last_conclusion = conclusions[-1] if conclusions else -1
    main_clauses = [m.start() for m in _MAIN_CLAUSE_RE.finditer(text, start, last.start())]
    last_main_clause = main_clauses[-1] if main_clauses else -1
    last_comma = text.rfind(",", start, last.start())
    ends = [m.end() for m in numbers]
    first = bisect.bisect_left([m.start() for m in numbers], start)
    sentence = _JUSTIFICATION_SENTENCE_RE.match(text, start)
    if sentence and _depth == 0 and first > 0 and last_conclusion < 0 and last_main_clause < sentence.end():
        return stated_number(text, numbers[:first], _depth + 1)  # "12. This is because 4 x 3."
    for word in _BACKWARD_RE.finditer(text, start, last.start()):
        before = bisect.bisect_right(ends, word.start())  # numbers ending before the word
        if before <= first:
            continue  # no number stated before it in this sentence
        fronted = _FRONTED_RE.search(text, max(start, word.start() - 40), word.start())
        if fronted and (fronted.group("semi") is None or last_comma > word.end()):
            continue
        gap = word.start() - numbers[before - 1].end()
        direct = gap <= 12 and _DIRECT_GAP_RE.fullmatch(text, numbers[before - 1].end(), word.start())
        if not direct and last_main_clause > word.end():
            continue  # "After 2 hours, since ..., the distance is 60"
        if last_conclusion > word.start():
            continue  # the sentence concludes after the justification
        if _RESULT_GAP_RE.search(text, word.end(), last.start()) and _value_key(last) in {
            _value_key(n) for n in numbers[first:before]
        }:
            return last  # "55 minutes before 60 because 300 - 245 = 55": the result restated
        return numbers[before - 1]
    return last


def _value_key(number: re.Match) -> str:
    """A number match compared by its digits: ``"1,320"`` and ``"1320"`` agree."""
    return number.group(0).replace(",", "")


def extract_answer(text: str, *, last_number_fallback: bool = True) -> tuple[str | None, str]:
    """Read the final answer from a model response.

    Returns:
      ``(answer, source)``: ``source`` is ``"boxed"``, ``"answer_is"``, ``"last_number"``,
      ``"empty_box"`` (the final box is empty: no answer, see :func:`final_boxed`) or ``"none"``
      (for those two ``answer`` is None). Unicode math is first spelled out
      (:func:`plain_math_text`).
    """
    text = plain_math_text(text)
    boxed = final_boxed(text)
    if boxed == "":
        return None, "empty_box"
    if boxed is not None:
        return boxed, "boxed"
    stated = _answer_is(text)
    if stated is not None:
        return stated, "answer_is"
    if last_number_fallback:
        number = last_number(text)
        if number is not None:
            return number, "last_number"
    return None, "none"


def gsm8k_final_answer(solution: str) -> str:
    """Gold answer of a GSM8K worked solution: text after the last ``####``, no ``,`` separators.

    Raises:
      ValueError: if there is no ``####`` marker or nothing after it.
    """
    if "####" not in solution:
        raise ValueError(f"GSM8K solution has no '####' final-answer marker: {solution[-80:]!r}")
    answer = solution.rsplit("####", 1)[1].strip()
    answer = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", answer)
    if not answer:
        raise ValueError(f"GSM8K solution has an empty answer after '####': {solution[-80:]!r}")
    return answer


# ----------------------------------------------------------------------------------------------
# Normalization and numeric parsing (fallbacks)
# ----------------------------------------------------------------------------------------------

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|mbox|mathrm)\s*\{([^{}]*)\}")


# Words after a number that are mathematics, not units: "3 pi", "2 and 3", "4 times 5",
# "2 cubed", "4 log 2". A magnitude is a unit: "$4 million" is 4 (GSM8K's gold answers count in
# the question's unit).
_NOT_UNITS = frozenset(
    "and or to plus minus times over divided by pi sqrt mod of squared cubed factorial choose"
    " log ln exp sin cos tan sec csc cot root".split()
)


def strip_units(answer: str) -> str:
    """Drop plain-word units after a number: ``"18 dollars"`` -> ``"18"``, ``"5 cm."`` -> ``"5"``.

    Only applies when the whole string is an (optionally ``$``-prefixed) number, whitespace,
    then words of two or more letters none of which is mathematical (``"5x"``, ``"5 x"``,
    ``"3 pi"`` and ``"2 and 3"`` are kept); anything else is returned unchanged (stripped).
    """
    s = answer.strip()
    # one split of the words only (a separator between two words is required), so a long
    # run of letters cannot make the match exponential
    words = r"[A-Za-z]{2,}(?:(?:\.\s*|\s+)[A-Za-z]{2,})*\.?"
    m = re.fullmatch(rf"\\?\$?\s*({_NUM}(?:,\d{{3}})*)\s+({words})\s*", s)
    if not m or any(w.strip(".").lower() in _NOT_UNITS for w in m.group(2).split()):
        return s
    return m.group(1)


def normalize_answer(answer: str) -> str:
    """Canonical string form for exact comparison.

    Removes spaces, ``$``, ``\\left``/``\\right``, thin spaces (``\\!``, ``\\,``, ``\\;``),
    degrees (``^\\circ``, ``°``), ``\\text{..}`` units after a number, a trailing period and
    thousands separators of a plain number; maps ``\\dfrac``/``\\tfrac`` to ``\\frac``.
    """
    s = answer.strip()
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
    s = re.sub(r"\\[!,;:]|\\ |~", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\^\s*(?:\{\s*)?\\circ\s*\}?|°|\\degree", "", s)
    s = s.replace("\\$", "").replace("$", "")
    # "5\text{ cm}" -> "5"; a lone "\text{(C)}" -> "(C)".
    s = re.sub(rf"^({_NUM})\s*{_TEXT_CMD_RE.pattern}\s*$", r"\1", s)
    s = _TEXT_CMD_RE.sub(r"\1", s)
    s = strip_units(s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    return s


_FRAC_RE = re.compile(r"(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}|(-?)\\frac(\d)(\d)")


def _exponent_ok(exponent: str) -> bool:
    """A decimal exponent small enough to build exactly (``|n| <= MAX_EXPONENT``)."""
    digits = exponent.lstrip("+-")
    return len(digits) <= 6 and int(digits) <= MAX_EXPONENT


def _plain_number(s: str) -> fractions.Fraction | None:
    """``"3"``, ``"-0.25"``, ``"14/3"``, ``"1e3"`` as an exact Fraction, else None."""
    m = re.fullmatch(rf"{_NUM}(?:[eE]([-+]?\d+))?(?:/{_NUM})?", s)
    if not m or (m.group(1) and not _exponent_ok(m.group(1))):
        return None
    try:
        if "/" in s:
            num, den = s.split("/")
            return fractions.Fraction(num) / fractions.Fraction(den)
        return fractions.Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _fraction_value(s: str) -> fractions.Fraction | None:
    """Value of ``\\frac{a}{b}``, ``-\\frac12``, or a mixed number ``2\\frac{1}{3}``."""
    m = re.fullmatch(rf"({_NUM})?({_FRAC_RE.pattern})", s)
    if not m:
        return None
    whole_str, _, sign1, num, den, sign2, num_d, den_d = m.groups()
    num, den = (num, den) if num is not None else (num_d, den_d)
    a, b = _plain_number(num), _plain_number(den)
    if a is None or b is None or b == 0:
        return None
    value = a / b
    if (sign1 or sign2) == "-":
        value = -value
    if whole_str is None:
        return value
    whole = _plain_number(whole_str)
    if whole is None or value < 0:
        return None
    return whole - value if whole < 0 or whole_str.startswith("-") else whole + value


# The exponent of 10^{n} / 10^(n) / 10^n in groups e2 / e3 / e4.
_POW10_NAMED = _pow10(r"(?P<e>[-+]?\d+)")
for _group in ("e2", "e3", "e4"):
    _POW10_NAMED = _POW10_NAMED.replace("(?P<e>", f"(?P<{_group}>", 1)
_SCI_RE = re.compile(
    rf"(?P<mant>[-+]?(?:\d+(?:\.\d*)?|\.\d+))"
    rf"(?:[eE](?P<e1>[-+]?\d+)"
    rf"|\s*{_TIMES}\s*{_POW10_NAMED})",
    re.IGNORECASE,
)
_DEC_HEAD = r"(?P<sign>[-+]?)(?P<int>\d*)\.(?P<frac>\d*)"
_PAREN_RE = re.compile(rf"{_DEC_HEAD}(?:\((?P<rep>\d+)\)|\[(?P<rep1>\d+)\])")
_OVERLINE_RE = re.compile(rf"{_DEC_HEAD}\\(?:overline|bar)\s*(?:\{{(?P<rep>\d+)\}}|(?P<rep1>\d))")
_DOTS_RE = re.compile(
    rf"{_DEC_HEAD}\\dot\s*\{{?(?P<first>\d)\}}?(?:(?P<mid>\d*)\\dot\s*\{{?(?P<last>\d)\}}?)?"
)
_ELLIPSIS_RE = re.compile(rf"{_DEC_HEAD}\s*{_ELLIPSIS}")
_REPEAT_WORD_RE = re.compile(rf"{_DEC_HEAD}\s+{_REPEAT_WORD}", re.IGNORECASE)
_REPEAT_PHRASE_RE = re.compile(rf"{_DEC_HEAD}{_REPEAT_PHRASE}", re.IGNORECASE)
# A unit word after a notation: "meters", "km.", "m/s" (a single letter alone is a variable).
_UNIT_WORD_RE = re.compile(r"[A-Za-z]{2,}\.?|[A-Za-z]+(?:/[A-Za-z]+)+\.?")


def _notation_text(answer: str) -> str:
    """The answer without ``$``, ``\\left``/``\\right``, thin spaces, ``\\text`` or a final period."""
    s = answer.strip().replace("\\$", "").replace("$", "")
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])|\\[!,;:]|~", "", s)
    s = _TEXT_CMD_RE.sub(r" \1 ", s).strip()
    if s.endswith(".") and not re.search(rf"{_ELLIPSIS}$", s):
        s = s[:-1].rstrip()
    return s


def _scientific_value(s: str) -> fractions.Fraction | None:
    """``1.5e3``, ``2.5E-4``, ``1.5 x 10^3``, ``1.5 \\times 10^{3}``, ``3*10^8``, ``3 * 10**8``,
    ``3 x 10^(8)`` exactly."""
    m = _SCI_RE.fullmatch(s)
    if not m:
        return None
    exponent = m.group("e1") or m.group("e2") or m.group("e3") or m.group("e4")
    if not _exponent_ok(exponent) or len(m.group("mant")) > MAX_NOTATION_DIGITS:
        return None
    return fractions.Fraction(m.group("mant")) * fractions.Fraction(10) ** int(exponent)


def _repeating(sign: str, whole: str, pre: str, rep: str) -> fractions.Fraction | None:
    """``sign whole . pre (rep)(rep)...`` as an exact Fraction (``0.1(6)`` = 1/6)."""
    if not rep or len(whole) + len(pre) + len(rep) > MAX_NOTATION_DIGITS:
        return None
    value = int(whole or "0") + fractions.Fraction(int(pre or "0"), 10 ** len(pre))
    value += fractions.Fraction(int(rep), (10 ** len(rep) - 1) * 10 ** len(pre))
    return -value if sign == "-" else value


def repeated_tail(frac: str) -> tuple[str, str] | None:
    """Split decimal digits into ``(pre, repetend)`` when they end in a block written twice.

    The repetend is the shortest block ``B`` with ``frac`` ending in ``BB``: ``"333"`` ->
    ``("33", "3")``, ``"1666"`` -> ``("166", "6")``, ``"142857142857"`` -> ``("142857", "142857")``.
    None when no block is repeated (``"3"``, ``"14159"``): an ellipsis there marks truncation.
    """
    for k in range(1, len(frac) // 2 + 1):
        if frac[-k:] == frac[-2 * k : -k]:
            return frac[:-k], frac[-k:]
    return None


def _repeating_value(s: str) -> fractions.Fraction | None:
    """Exact value of a repeating decimal written as ``0.(3)``, ``0.\\overline{3}``, ``0.\\dot{3}``,
    ``0.333...`` or ``0.3 repeating`` (rules in :func:`notation_value`)."""
    for regex in (_PAREN_RE, _OVERLINE_RE):
        m = regex.fullmatch(s)
        if m:
            rep = m.groupdict().get("rep") or m.groupdict().get("rep1")
            return _repeating(m["sign"], m["int"], m["frac"], rep)
    m = _DOTS_RE.fullmatch(s)
    if m:
        rep = m["first"] + (m["mid"] + m["last"] if m["last"] else "")
        return _repeating(m["sign"], m["int"], m["frac"], rep)
    m = _ELLIPSIS_RE.fullmatch(s)
    if m:
        split = repeated_tail(m["frac"])
        return _repeating(m["sign"], m["int"], *split) if split else None
    m = _REPEAT_WORD_RE.fullmatch(s)
    if m and m["frac"]:
        pre, rep = repeated_tail(m["frac"]) or ("", m["frac"])
        return _repeating(m["sign"], m["int"], pre, rep)
    m = _REPEAT_PHRASE_RE.fullmatch(s)
    if m:  # "0.16 with the 6 repeating": the named block ends the decimals, or follows them
        rep, frac = m["rep"] or m["rep2"], m["frac"]
        pre = frac[: len(frac) - len(rep)] if frac.endswith(rep) else frac
        return _repeating(m["sign"], m["int"], pre, rep)
    return None


def notation_value(answer: str) -> fractions.Fraction | None:
    """Exact value of a number in scientific or repeating-decimal notation, else None.

    Unicode is spelled out first (:func:`plain_math_text`: ``−``, ``10⁵``, ``0.3̅``).
    Scientific: a decimal mantissa then ``e``/``E`` and an integer exponent, or then ``x``,
    ``X``, ``×``, ``*``, ``·``, ``\\times`` or ``\\cdot`` and ``10^n`` / ``10^{n}`` / ``10^(n)`` /
    ``10**n`` (the whole answer must be that number, so ``5x`` or ``2e`` stay expressions);
    ``|n| > MAX_EXPONENT`` -> None. A magnitude word is a unit like any other (``4 million`` is 4,
    as in GSM8K, whose gold answers count in the question's unit).
    Repeating: the repetend marked by parentheses or brackets after the decimal point
    (``0.(3)``, ``1.2(3)``, ``0.[3]``; ``2(3)`` without a point stays a product),
    ``\\overline``/``\\bar``, or ``\\dot`` over one digit or over the first and last digits of
    the block (``0.\\dot{1}4285\\dot{7}``).
    An ellipsis (``...``, ``…``, ``\\ldots``, ``\\dots``, ``\\cdots``) counts only when the digits
    before it end in a block written at least twice (:func:`repeated_tail`): ``0.33...`` and
    ``0.1666...`` repeat, ``0.3...`` and ``3.14159...`` do not (None). The word ``repeating`` /
    ``recurring`` uses that block if there is one, else all the decimals repeat
    (``0.3 repeating`` = 1/3, ``0.16 repeating`` = 16/99). A named block (``0.1 with 6
    repeating``, ``0.16 with the 6 repeating``, ``0.1666 (6 repeating)``) is the repetend: the
    decimals end with one copy of it or are followed by it (all three are 1/6).
    Mixed numbers (:func:`_mixed_value`): ``2 1/2`` and ``2\\frac{1}{2}`` are 5/2, ``-2 1/2`` is
    -5/2 (a proper fraction after the whole part only: ``2 3/2`` is not one).
    Plain decimals (``0.33``, ``0.3333``) are not notations: they keep their finite value.
    Unit words after the number are dropped (``1.2e5 meters``, ``3 x 10^8 m/s``; a single letter
    is a variable, as in :func:`strip_units`).
    """
    s = _notation_text(plain_math_text(answer))
    if len(s) > 4 * MAX_NOTATION_DIGITS:
        return None
    value = _notation_value(s)
    if value is None:  # "1.2e5 meters", "3 x 10^8 m/s", "0.3 repeating cm": unit words after it
        words = s.split()
        k = len(words)
        while k > 1 and _unit_word(words[k - 1]):
            k -= 1
        if k < len(words):
            value = _notation_value(" ".join(words[:k]))
    return value


def _notation_value(s: str) -> fractions.Fraction | None:
    value = _scientific_value(s)
    if value is None:
        value = _repeating_value(s)
    return value if value is not None else _mixed_value(s)


_MIXED_RE = re.compile(
    r"(?<![\w.^_})\]/\\])(?P<whole>\d+)[ \t]+(?P<num>\d+)/(?P<den>\d+)(?![\w/^(]|\.\d)"
)
_MIXED_WHOLE_RE = re.compile(
    r"(?P<sign>[-+]?)(?P<whole>\d+)(?:[ \t]+(?P<num>\d+)/(?P<den>\d+)"
    r"|\s*\\[dt]?frac\s*\{\s*(?P<num2>\d+)\s*\}\s*\{\s*(?P<den2>\d+)\s*\})"
)


def _mixed_parts(whole: str, num: str, den: str) -> fractions.Fraction | None:
    """``whole + num/den`` when ``num/den`` is a proper fraction (``0 < num < den``), else None:
    ``2 3/2`` or ``2 0/5`` is not a mixed number."""
    if max(len(whole), len(num), len(den)) > MAX_NOTATION_DIGITS or not 0 < int(num) < int(den):
        return None
    return int(whole) + fractions.Fraction(int(num), int(den))


def _mixed_value(s: str) -> fractions.Fraction | None:
    """``2 1/2``, ``-2 1/2``, ``2\\frac{1}{2}`` as an exact Fraction (5/2, -5/2), else None."""
    m = _MIXED_WHOLE_RE.fullmatch(s)
    if not m:
        return None
    value = _mixed_parts(m["whole"], m["num"] or m["num2"], m["den"] or m["den2"])
    return -value if value is not None and m["sign"] == "-" else value


def rewrite_mixed_numbers(answer: str) -> str:
    """Each plain-text mixed number in ``answer`` as an exact, braced ``\\frac``: ``"x = 2 1/2"``
    -> ``"x = {\\frac{5}{2}}"`` (math-verify reads ``2 1/2`` as a product). Only a proper fraction
    after the whole part (``2 3/2`` stays); never across an operator (``2 \\cdot 1/2``,
    ``2 * 1/2``) or after an exponent, subscript or closing bracket."""

    def exact(m: re.Match) -> str:
        value = _mixed_parts(m["whole"], m["num"], m["den"])
        return m.group(0) if value is None else "{" + fraction_latex(value) + "}"

    return _MIXED_RE.sub(exact, answer)


def _unit_word(word: str) -> bool:
    """Whether ``word`` is a unit: two or more letters (or letters over letters, ``m/s``), not
    mathematical and not a repeating-decimal word (the rule of :func:`strip_units`)."""
    return (
        _UNIT_WORD_RE.fullmatch(word) is not None
        and not any(w.lower() in _NOT_UNITS for w in re.split(r"[/.]", word) if w)
        and not re.fullmatch(rf"{_REPEAT_VERB}\.?", word, re.IGNORECASE)
    )


def fraction_latex(value: fractions.Fraction) -> str:
    """``1500``, ``\\frac{1}{3}``, ``-\\frac{37}{30}``: an exact value every later step parses."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def rewrite_notation(answer: str) -> str:
    """The answer as an exact integer / ``\\frac`` when it is in a :func:`notation_value` notation,
    else unchanged (math-verify reads ``1.5e3`` as ``1.5 e 3`` and ``0.(3)`` as a product)."""
    value = notation_value(answer)
    return answer if value is None else fraction_latex(value)


def parse_numbers(answer: str) -> list[fractions.Fraction] | None:
    """Candidate numeric values of an answer, or None if it is not a plain number.

    Integers, decimals, ``a/b``, ``\\frac{a}{b}`` (and mixed numbers) give one value; a
    percentage ``p%`` gives two, ``p`` and ``p/100`` (gold ``50`` and ``50\\%`` both mean 50%).
    """
    s = normalize_answer(answer)
    percent = False
    if s.endswith("\\%") or s.endswith("%"):
        s, percent = s.removesuffix("%").removesuffix("\\"), True
    value = _plain_number(s)
    if value is None:
        value = _fraction_value(s)
    if value is None:
        return None
    return [value, value / 100] if percent else [value]


def numeric_equal(a: str, b: str, rel_tol: float = NUMERIC_REL_TOL) -> bool | None:
    """True/False when both sides parse as numbers (relative tolerance), None otherwise."""
    xs, ys = parse_numbers(a), parse_numbers(b)
    if xs is None or ys is None:
        return None
    tol = fractions.Fraction(repr(rel_tol))  # exact, and no float overflow on 1e400
    return any(abs(x - y) <= tol * max(abs(x), abs(y)) for x in xs for y in ys)


# ----------------------------------------------------------------------------------------------
# math-verify in a killable worker process
# ----------------------------------------------------------------------------------------------


def math_verify_equal(gold: str, pred: str) -> bool | None:
    """math-verify equivalence of two extracted answers; None if either side does not parse.

    Two rules on top of math-verify's own:
      * an exact gold (no decimal number in it: integers, fractions, radicals, ``\\pi``, ``e``,
        expressions) needs an exactly equal answer: each decimal of the response is read as the
        exact fraction it writes (``0.5`` = 1/2, ``0.3333333333`` = 3333333333/10^10), so
        math-verify's 6-decimal rounding (which only applies when a float is present) never
        accepts a rounded value; a decimal gold keeps that rounding (``0.142857`` matches 1/7);
      * an inequality answer and an interval answer are compared as solution sets
        (:func:`_inequality_set`: ``x > 2`` = ``(2, \\infty)``, ``1 < x < 3`` = ``(1, 3)``,
        ``x \\le -1 \\text{ or } x > 2`` = ``(-\\infty, -1] \\cup (2, \\infty)``).

    Runs math-verify's own timeouts off (they use SIGALRM); the caller enforces the limit by
    running this in :class:`VerifyWorker`. Exceptions propagate.
    """
    from math_verify import verify  # local: sympy is heavy and only the worker needs it

    gold_parsed, pred_parsed = _mv_parse(gold), _mv_parse(pred)
    if not gold_parsed or not pred_parsed:
        return None
    exact = not any(_has_float(g) for g in gold_parsed)
    if exact:
        if _numerically_apart(gold_parsed, pred_parsed):
            return False  # no exact arithmetic needed: (1.0000001)^{10000000} is not e
        pred_parsed = [_exact_decimals(p) for p in pred_parsed]
    as_sets = _solution_sets_equal(gold, pred, gold_parsed, pred_parsed, exact)
    if as_sets is not None:
        return as_sets
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None, raise_on_error=True))


def _mv_parse(answer: str) -> list:
    from math_verify import parse

    return parse(f"$\\boxed{{{answer}}}$", parsing_timeout=None, raise_on_error=True)


def _has_float(expr: Any) -> bool:
    from sympy import Basic, Float, MatrixBase

    if isinstance(expr, MatrixBase):
        return any(_has_float(e) for e in expr)
    return isinstance(expr, Basic) and bool(expr.atoms(Float))


def _numerically_apart(gold_parsed: list, pred_parsed: list) -> bool:
    """Whether two parsed numbers (no variables, no percent) differ by more than 1e-12 relative
    at 30 digits, so they cannot be exactly equal; False when that cannot be told cheaply."""
    from sympy import Basic, UnevaluatedExpr

    gold = next((e for e in gold_parsed if isinstance(e, Basic)), None)
    pred = next((e for e in pred_parsed if isinstance(e, Basic)), None)
    if not (getattr(gold, "is_number", False) and getattr(pred, "is_number", False)):
        return False
    if gold.has(UnevaluatedExpr) or pred.has(UnevaluatedExpr):  # "25\%" is read by math-verify
        return False
    try:
        a, b = complex(gold.evalf(30)), complex(pred.evalf(30))
    except (TypeError, ValueError, OverflowError, ArithmeticError):
        return False
    return abs(a - b) > 1e-12 * max(abs(a), abs(b), 1.0)


def _exact_decimals(expr: Any) -> Any:
    """``expr`` with each float replaced by the exact rational of its decimal digits (a parsed
    ``0.3333333333`` is ``3333333333/10^10``). The order of latex2sympy's sets and conjunctions
    (``_unsorted_args``, used to compare with tuples) is kept."""
    from sympy import Basic, Float, MatrixBase, Rational

    if isinstance(expr, MatrixBase):
        return expr.applyfunc(_exact_decimals)
    if not isinstance(expr, Basic) or not expr.atoms(Float):
        return expr
    if isinstance(expr, Float):
        return Rational(str(expr))
    args = getattr(expr, "_unsorted_args", None) or expr.args
    return expr.func(*[_exact_decimals(a) for a in args])


# Relations and the connectives between them, in an inequality answer.
_RELATION_RE = re.compile(r"[<>\u2264\u2265\u2260]|\\(?:[lg]eq?|[lg]eqslant|[lg]t|neq?)(?![A-Za-z])")
_OR_RE = re.compile(
    r"\\(?:text|mbox|textrm|mathrm)\s*\{\s*or\s*\}|\bor\b|\\(?:lor|vee)(?![A-Za-z])", re.IGNORECASE
)
_AND_RE = re.compile(
    r"\\(?:text|mbox|textrm|mathrm)\s*\{\s*and\s*\}|\band\b|\\(?:land|wedge)(?![A-Za-z])", re.IGNORECASE
)
_SPACING_RE = re.compile(r"\\q?quad(?![A-Za-z])|\\[,;:! ]|\\\(|\\\)|\$")


def _inequality_set(answer: str, exact: bool) -> Any:
    """The solution set of an inequality answer in one variable, or None.

    ``x > 2``, ``2 < x``, ``x \\geq 2``, ``1 < x < 3``, ``x \\neq 2``, parts joined by ``or``
    (union: ``x \\le -1 \\text{ or } x > 2``) and ``and`` (intersection); every part a relation
    (or a chain of them) in the same single variable. A comma between parts is ambiguous (it
    could mean either): None, as for anything else that is not such an answer.
    """
    from sympy import Basic, Eq, Intersection, Set, Union
    from sympy.core.relational import Relational

    text = answer.replace("\u2264", "\\le ").replace("\u2265", "\\ge ").replace("\u2260", "\\ne ")
    text = _SPACING_RE.sub(" ", text)
    if not _RELATION_RE.search(text) or "," in text:
        return None
    variable = None
    union = []
    for or_part in _OR_RE.split(text):
        sets = []
        for part in _AND_RE.split(or_part):
            part = part.strip().rstrip(".").strip()
            parsed = [e for e in _mv_parse(part) if isinstance(e, Basic)] if part else []
            if not parsed:
                return None
            relation = _exact_decimals(parsed[0]) if exact else parsed[0]
            relations = getattr(relation, "_unsorted_args", None) or [relation]
            if not all(isinstance(r, Relational) for r in relations):
                return None
            symbols = relation.free_symbols
            if len(symbols) != 1 or (variable is not None and symbols != variable):
                return None
            variable = symbols
            if isinstance(relation, Eq) and isinstance(relation.rhs, Set):
                return None  # "x \in (2, \infty)": math-verify reads it
            sets.append(relation.as_set())
        union.append(Intersection(*sets) if len(sets) > 1 else sets[0])
    return Union(*union) if len(union) > 1 else union[0]


def _solution_sets_equal(
    gold: str, pred: str, gold_parsed: list, pred_parsed: list, exact: bool
) -> bool | None:
    """Whether an inequality answer and an interval answer (either side the gold) denote the same
    set of reals; None when the two are not one of each (math-verify decides)."""
    from sympy import Basic, FiniteSet, Set

    def interval(parsed: list) -> Any:
        first = next((e for e in parsed if isinstance(e, Basic)), None)
        return first if isinstance(first, Set) and not isinstance(first, FiniteSet) else None

    gold_interval, pred_interval = interval(gold_parsed), interval(pred_parsed)
    if (gold_interval is None) == (pred_interval is None):
        return None
    if gold_interval is not None:
        other = _inequality_set(pred, exact)
        left, right = gold_interval, other
    else:
        other = _inequality_set(gold, False)
        left, right = other, pred_interval
    if other is None:
        return None
    if left == right:
        return True
    return left.symmetric_difference(right).is_empty is True


def _resolve(spec: str):
    """Import ``"package.module:function"``."""
    module_name, _, attr = spec.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_main(verify_fn_spec: str, memory_limit_mb: int) -> None:
    """Worker loop: one JSON request per stdin line, one JSON reply per stdout line.

    Request ``{"gold": str, "pred": str}``; reply ``{"equal": true|false|null}`` or
    ``{"error": "Type: message"}``. Exits on stdin EOF or when the parent process dies.
    """
    import logging

    logging.disable(logging.CRITICAL)  # math-verify warns on every call with timeouts off
    if memory_limit_mb > 0:
        try:
            import resource

            limit = memory_limit_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ImportError, ValueError, OSError):
            pass
    exit_when_orphaned()
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints must not corrupt the protocol
    try:
        verify_fn = _resolve(verify_fn_spec)
        if verify_fn_spec == DEFAULT_VERIFY_FN:
            verify_fn("1", "1")  # warm up: import sympy before the first timed item
        out.write(json.dumps({"ready": True}) + "\n")
    except BaseException as exc:  # noqa: BLE001 - report any startup failure to the parent
        out.write(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"equal": verify_fn(request["gold"], request["pred"])}
        except BaseException as exc:  # noqa: BLE001 - MemoryError, RecursionError, sympy errors
            reply = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


class VerifyTimeout(Exception):
    """The worker did not answer within the per-item time limit (it has been killed)."""


class VerifyWorkerError(Exception):
    """The worker failed to start, crashed, or its verify function raised."""


class VerifyWorker:
    """A persistent worker process running an equivalence function under a hard time limit.

    ``check(gold, pred, timeout_s)`` sends one pair; if no reply arrives within ``timeout_s``
    seconds the process is killed (SIGKILL) and :class:`VerifyTimeout` is raised; the next call
    starts a fresh process. The worker is a plain ``subprocess`` (not ``multiprocessing``), so
    it also works inside daemonic pool workers, and it exits by itself when its parent dies.
    Thread-safe (one request at a time). Fork-safe: a forked child starts its own worker.

    Args:
      verify_fn: ``"module:function"`` taking ``(gold, pred)`` and returning True/False/None
        (None = could not parse); importable in a fresh interpreter with the caller's sys.path.
      memory_limit_mb: address-space limit of the worker (0 = none).
      startup_timeout_s: how long to wait for the worker to import its function.
    """

    def __init__(
        self,
        verify_fn: str = DEFAULT_VERIFY_FN,
        *,
        memory_limit_mb: int = 4096,
        startup_timeout_s: float = 120.0,
    ) -> None:
        self.verify_fn = verify_fn
        self.memory_limit_mb = memory_limit_mb
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._pid = os.getpid()
        self._buffer = b""
        self._lock = threading.Lock()
        self.starts = 0
        atexit.register(self.close)

    def _start(self) -> None:
        code = (
            "import sys; from marft_jax.envs.math_grading import _worker_main; "
            f"_worker_main({self.verify_fn!r}, {int(self.memory_limit_mb)})"
        )
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self._buffer = b""
        try:
            reply = self._read_reply(self.startup_timeout_s)
        except VerifyTimeout as exc:
            raise VerifyWorkerError(f"verify worker did not start in {self.startup_timeout_s} s") from exc
        if not reply.get("ready"):
            self._kill()
            raise VerifyWorkerError(f"verify worker failed to start {self.verify_fn!r}: {reply.get('error')}")

    def _read_reply(self, timeout_s: float) -> dict[str, Any]:
        """Read one JSON line from the worker, killing it after ``timeout_s`` seconds."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill()
                raise VerifyTimeout(f"no answer within {timeout_s} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    self._kill()
                    raise VerifyWorkerError("verify worker exited unexpectedly")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for stream in (self._proc.stdin, self._proc.stdout):
                if stream is not None:
                    stream.close()
            self._proc = None

    def check(self, gold: str, pred: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool | None:
        """Equivalence of ``gold`` and ``pred``; None if the verifier could not parse them.

        Raises:
          VerifyTimeout: no answer within ``timeout_s`` (the worker was killed and replaced).
          VerifyWorkerError: the worker crashed or the verify function raised.
        """
        with self._lock:
            if os.getpid() != self._pid:  # forked copy: never touch the parent's process
                self._proc, self._pid = None, os.getpid()
            if self._proc is None or self._proc.poll() is not None:
                if self._proc is not None:
                    self._kill()
                self._start()
                self.starts += 1
            assert self._proc is not None and self._proc.stdin is not None
            try:
                self._proc.stdin.write((json.dumps({"gold": gold, "pred": pred}) + "\n").encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                self._kill()
                raise VerifyWorkerError(f"verify worker pipe closed: {exc}") from exc
            reply = self._read_reply(timeout_s)
        if "error" in reply:
            raise VerifyWorkerError(reply["error"])
        return reply["equal"]

    def close(self) -> None:
        """Stop the worker process (idempotent)."""
        if os.getpid() == self._pid:
            self._kill()


_DEFAULT_WORKER: VerifyWorker | None = None
_DEFAULT_WORKER_LOCK = threading.Lock()


def default_worker() -> VerifyWorker:
    """The per-process shared :class:`VerifyWorker` (started lazily on first use)."""
    global _DEFAULT_WORKER
    with _DEFAULT_WORKER_LOCK:
        if _DEFAULT_WORKER is None or _DEFAULT_WORKER._pid != os.getpid():
            _DEFAULT_WORKER = VerifyWorker()
        return _DEFAULT_WORKER


# ----------------------------------------------------------------------------------------------
# Grading
# ----------------------------------------------------------------------------------------------


def _integer_key(digits: str) -> str:
    """Canonical form of an integer string, compared as text (``int()`` refuses 4300+ digits):
    ``"007"`` -> ``"7"``, ``"-0"`` -> ``"0"``."""
    sign, magnitude = ("-", digits[1:]) if digits.startswith("-") else ("", digits)
    magnitude = magnitude.lstrip("0") or "0"
    return magnitude if magnitude == "0" else sign + magnitude


# A decimal number in a gold answer ("0.25", "3.14", ".5", "12.5\\%"): closeness is allowed only then.
_DECIMAL_RE = re.compile(r"\d\.\d|(?<![\w.])\.\d")
_PERCENT_END_RE = re.compile(r"\s*\\?%\s*\.?\s*$")


def is_decimal_gold(gold: str) -> bool:
    """Whether the gold answer is written with a decimal number (after :func:`rewrite_notation`:
    ``1.5e3`` and ``0.(3)`` are exact). Only such a gold allows a close value; every other gold
    (integers, fractions, radicals, ``\\pi``, ``e``, expressions) needs an exactly equal answer."""
    return _DECIMAL_RE.search(gold) is not None


def percent_gold(gold: str, pred: str) -> str:
    """The gold a response is compared with when the gold is a percentage.

    A gold ``p\\%`` asks for a percentage: a response without a percent sign is read in percent,
    so it is compared with ``p`` (``25`` matches ``25\\%``, ``0.25`` and ``\\frac14`` do not, as a
    MATH grader reads them: 0.25 %). A response with the sign is compared with the gold as written
    (math-verify: ``25\\%`` = ``25\\%``); a response ``p\\%`` for a gold without one keeps the
    existing rule (``50\\%`` matches ``50`` and ``0.5``: the sign states the unit).
    """
    if "%" in pred or not _PERCENT_END_RE.search(gold):
        return gold
    return _PERCENT_END_RE.sub("", gold)


def answers_equivalent(
    pred: str,
    gold: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    worker: VerifyWorker | None = None,
) -> tuple[bool, dict[str, Any]]:
    """Decide whether an extracted answer equals the gold answer (see module docstring).

    Returns:
      ``(equal, info)`` with ``info["method"]`` and, when math-verify failed,
      ``info["verify_error"]`` (``"timeout"``, ``"unparsed"`` or the exception text).
    """
    pred, gold = plain_math_text(pred), plain_math_text(gold)
    pred, gold = rewrite_notation(pred), rewrite_notation(gold)
    pred, gold = rewrite_mixed_numbers(pred), rewrite_mixed_numbers(gold)
    gold = percent_gold(gold, pred)
    norm_pred, norm_gold = normalize_answer(pred), normalize_answer(gold)
    if norm_pred == norm_gold:
        return True, {"method": "exact"}
    if re.fullmatch(r"-?\d+", norm_pred) and re.fullmatch(r"-?\d+", norm_gold):
        return _integer_key(norm_pred) == _integer_key(norm_gold), {"method": "integer"}
    worker = worker if worker is not None else default_worker()
    try:
        equal = worker.check(gold, strip_units(pred), timeout_s)
        error = "unparsed" if equal is None else None
    except VerifyTimeout:
        error = "timeout"
    except VerifyWorkerError as exc:
        error = f"error: {exc}"
    if error is None:
        return bool(equal), {"method": "math_verify"}
    numeric = numeric_equal(pred, gold, NUMERIC_REL_TOL if is_decimal_gold(gold) else 0.0)
    if numeric is not None:
        return numeric, {"method": "numeric", "verify_error": error}
    return False, {"method": "fallback", "verify_error": error}


def grade(
    output_text: str,
    gold: str,
    *,
    last_number_fallback: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    worker: VerifyWorker | None = None,
) -> Score:
    """Score a model response against a gold answer: reward 1.0 if equivalent, else 0.0.

    Never raises on bad model output. ``info`` holds ``extracted``, ``extracted_from``,
    ``gold``, ``method``, and for reward 0 a ``reason``: ``"no_answer"``, ``"wrong"``,
    ``"timeout"`` or ``"verify_error"``.

    Raises:
      ValueError: if ``gold`` is empty (a dataset bug, not a model error).
    """
    gold = str(gold).strip()
    if not gold:
        raise ValueError("grade(): gold answer is empty")
    answer, source = extract_answer(output_text or "", last_number_fallback=last_number_fallback)
    info: dict[str, Any] = {"extracted": answer, "extracted_from": source, "gold": gold}
    if answer is None:
        return Score(0.0, {**info, "method": "none", "reason": "no_answer"})
    equal, details = answers_equivalent(answer, gold, timeout_s=timeout_s, worker=worker)
    info.update(details)
    if equal:
        return Score(1.0, info)
    error = details.get("verify_error")
    if details["method"] == "fallback":
        info["reason"] = "timeout" if error == "timeout" else "verify_error"
    else:
        info["reason"] = "wrong"
    return Score(0.0, info)
