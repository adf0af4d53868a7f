"""Verifiable rewards: answer extraction, a math verifier, a registry and a batch scorer.

A reward function maps ``(response: str, gold: str) -> float`` in ``[0, 1]``. Built-ins:

- ``math``: extract the final answer (last ``\\boxed{...}``, else GSM8K ``#### x``, else
  "the answer is x", else the last number) and compare it with the gold answer. When both sides
  are plain numbers (integers with or without thousands commas, decimals, ``a/b``, mixed
  numbers ``2 3/4``, ``\\frac{a}{b}``) they are compared *exactly* as rationals, in the calling
  process, without math-verify (the fast path), except two unequal numbers within 1e-6 of each
  other with a decimal on one side, which math-verify may call equal (it rounds floats to 6
  decimals: ``0.333333`` is ``1/3``) and so decides. Everything else goes to
  ``math_verify.verify(parse(gold), parse(pred))`` (the slow path). Both sides are first written
  the ASCII way (see ``_normalize_unicode``: ``2½`` is ``\\frac{5}{2}``, ``5²`` is ``5^{2}``, a
  fullwidth minus is ``-``, invisible format characters go, ``·`` is ``\\cdot``, ``√12`` is
  ``\\sqrt{12}``). A percent (``12.5%``) equals its number and its fraction (as math-verify has
  it for whole numbers); ``1.2e3`` inside other math is ``1.2 \\times 10^{3}`` to math-verify.
- ``exact``: string equality of the normalized final answer and the normalized gold.
- ``numeric_closeness``: ``exp(-|pred - gold| / max(|gold|, 1))``, a continuous reward.

``RewardComputer(name, num_workers, timeout_s).score(responses, golds)`` scores a batch: fast
paths run in the calling process; the rest run in a process pool (``num_workers > 0``, spawn
or forkserver context) or in-process in the main thread (``num_workers == 0``). Each slow item
has a timeout: a ``SIGALRM`` timer inside the worker (soft, the worker survives) and a deadline
in the parent (hard: a worker that does not answer in time, e.g. stuck in C code with signals
blocked, is killed and the pool replaced). A reward function that raises or times out gives
0.0 and is counted in :class:`RewardStats`; a reward that is not a finite number in ``[0, 1]``
is a ``ValueError`` naming the batch index (the trainer maps indices to prompt and agent), and
so, for the built-in rewards, is a gold answer that is not a non-empty string.

This module imports only the standard library at import time; math-verify (and sympy) are
imported on first use of the slow path.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import math
import multiprocessing
import os
import pickle
import re
import signal
import threading
import time
import unicodedata
from fractions import Fraction
from typing import Callable, Optional, Sequence

from .signals import signals_deferred

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]
FastPathFn = Callable[[str, str], Optional[float]]

__all__ = [
    "RewardFn", "RewardSpec", "RewardStats", "RewardComputer", "register_reward",
    "get_reward_fn", "get_reward_spec", "list_rewards", "extract_answer", "extract_boxed",
    "gold_answer",
    "parse_number", "normalize_answer", "math_reward", "math_fast_path", "exact_reward",
    "numeric_closeness_reward",
]

# --------------------------------------------------------------------------------------------
# Answer extraction
# --------------------------------------------------------------------------------------------

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_GSM8K_RE = re.compile(r"####\s*((?:(?!####)[^\n])*)")   # to the next marker or line end
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*([^\n]*)", re.IGNORECASE)
# The end of a sentence: ".", "!" or "?" before a space or at the end of the line (not a decimal
# point: "3.5"): "The answer is 42!" is 42, not 42 factorial.
_SENTENCE_END_RE = re.compile(r"[.!?](?=\s|$)")
# A number: \frac{a}{b}, 1,234.5, 12.5, 3/4, .5 -- with an optional leading minus.
_NUMBER_RE = re.compile(
    r"-?\\[dt]?frac\{\d+\}\{\d+\}"
    r"|-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+(?!\.\d))?"
    r"|-?\.\d+"
)


# Minus signs that are not ASCII: U+2212 (the minus sign, common in LLM output and copied text),
# U+2013 (an en dash typeset as a minus), U+FF0D and U+FE63 (fullwidth and small hyphen-minus,
# from CJK text). Read as "-" everywhere: U+2212 then 7 is -7, not 7.
# Spaces that are not ASCII (no-break U+00A0, narrow no-break U+202F, thin U+2009: thousands
# separators in "1 000" as typeset) are spaces. The fraction slash U+2044 ("1⁄2") is "/".
# Invisible format characters (category Cf: zero-width spaces and joiners, bidi marks and
# embeddings around numbers in RTL text, the BOM, the soft hyphen) are deleted: "\u200f5" is 5.
# Two of them are arithmetic: the invisible times U+2062 and plus U+2064 ("2\u20623" is 2*3,
# not 23).
_INVISIBLE = ("\u00ad\u061c\u180e\u200b\u200c\u200d\u200e\u200f\u202a\u202b\u202c\u202d"
              "\u202e\u2060\u2061\u2063\u2066\u2067\u2068\u2069\ufeff")
_MINUS_TRANS = str.maketrans({"\u2212": "-", "\u2013": "-", "\uff0d": "-", "\ufe63": "-",
                              "\u00a0": " ", "\u202f": " ", "\u2009": " ", "\u2044": "/",
                              "\u2062": "*", "\u2064": "+", **dict.fromkeys(_INVISIBLE),
                              # signs math-verify does not read: "3·4" was 3, "∞" no value
                              "\u00b7": "\\cdot ", "\u22c5": "\\cdot ", "\u221e": "\\infty "})
# A square root sign before a number, one letter or a brace: "√12" is \sqrt{12} (math-verify
# read "√2" as no number at all).
_SQRT_RE = re.compile(r"\u221a\s*(\d+(?:\.\d+)?|[A-Za-z](?![A-Za-z])|(?=\{))")


def _vulgar_fractions() -> dict[str, str]:
    """``"½" -> "1/2"`` for each vulgar fraction character (not "⅟", a numerator alone)."""
    out = {}
    for c in map(chr, [*range(0xbc, 0xbf), *range(0x2150, 0x2190)]):
        if unicodedata.decomposition(c).startswith("<fraction>"):
            num, _, den = unicodedata.normalize("NFKC", c).partition("\u2044")
            if num.isdigit() and den.isdigit():
                out[c] = f"{num}/{den}"
    return out


_VULGAR = _vulgar_fractions()
_SUPERSCRIPT_DIGITS = "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079"
_SUBSCRIPT_DIGITS = "".join(map(chr, range(0x2080, 0x208a)))
_SCRIPT_TRANS = str.maketrans({**{c: str(i) for i, c in enumerate(_SUPERSCRIPT_DIGITS)},
                               **{c: str(i) for i, c in enumerate(_SUBSCRIPT_DIGITS)},
                               "\u207a": "+", "\u207b": "-"})
# A fraction written with one character ("½") or as superscript/subscript digits ("¹⁄₂", the
# slash already "/"), after an optional whole part: "2½" and "2 ½" are the mixed number 5/2.
# Each group starts where its run does ((?<!...)): a match is tried from a run's first
# character only, so a long run of digits or superscripts costs linear time, not quadratic.
_UNICODE_FRACTION_RE = re.compile(
    rf"(?:(?<!\d)(\d+) ?)?(?:([{''.join(_VULGAR)}])"
    rf"|(?<![{_SUPERSCRIPT_DIGITS}])([{_SUPERSCRIPT_DIGITS}]+)/([{_SUBSCRIPT_DIGITS}]+))")
# Superscript digits after a number or a bracket are a power: "5²" is 5^{2} (25), not 5. After a
# letter they are left as they are: "25 cm²" is 25 with a unit.
_POWER_RE = re.compile(rf"(?<=[\d)\]}}])[\u207a\u207b]?[{_SUPERSCRIPT_DIGITS}]+")


def _unicode_fraction(m: re.Match) -> str:
    """A fraction (after its whole part) as one improper ``\\frac{n}{d}``: math-verify reads
    "2 1/2" as 2 * 1/2 (so "x = 2½" matched "x = 3/2"), and the last-number rule took "1/2"."""
    num, _, den = (_VULGAR[m.group(2)] if m.group(2) else
                   f"{m.group(3).translate(_SCRIPT_TRANS)}/{m.group(4).translate(_SCRIPT_TRANS)}"
                   ).partition("/")
    whole = m.group(1) or "0"
    if len(whole) + len(num) + len(den) > 60 or int(den) == 0:   # no number: as it is
        return m.group(0)
    frac = f"\\frac{{{int(whole) * int(den) + int(num)}}}{{{int(den)}}}"
    after = " " if m.string[m.end():m.end() + 1].isdecimal() else ""    # "½5": not 1/25
    return frac + after


def _normalize_unicode(text: str) -> str:
    """Unicode signs, spaces, invisible characters, fractions and powers written the ASCII way
    (applied to responses and golds alike; ASCII text is returned as it is)."""
    if text.isascii():
        return text
    text = _UNICODE_FRACTION_RE.sub(_unicode_fraction, text.translate(_MINUS_TRANS))
    text = _SQRT_RE.sub(lambda m: f"\\sqrt{{{m.group(1)}}}" if m.group(1) else "\\sqrt", text)
    return _POWER_RE.sub(lambda m: "^{" + m.group(0).translate(_SCRIPT_TRANS) + "}", text)


def _touches_other_number(text: str, start: int, end: int) -> bool:
    """Whether ``text[start:end]`` (a number) touches a digit character that is not a decimal
    digit (Unicode category No: "5①", "5₂"): then it is not that plain number."""
    return ((start > 0 and unicodedata.category(text[start - 1]) == "No")
            or (end < len(text) and unicodedata.category(text[end]) == "No"))


def _number_beside_other(text: str) -> bool:
    """Whether a decimal digit in ``text`` touches a category-No character ("5①"): math-verify
    drops such a character, reading the number without it. (ASCII text has none.)"""
    return not text.isascii() and any(c.isdecimal() and _touches_other_number(text, i, i + 1)
                                      for i, c in enumerate(text))


_BRACE_RE = re.compile(r"[{}]")
_BOXED_TOKEN_RE = re.compile(r"[^\s$]+")


def _closing_braces(text: str) -> dict[int, int]:
    """Index of each balanced ``{`` -> index of its ``}``, in one pass (linear time: a
    response of thousands of unbalanced ``\\boxed{`` must not cost quadratic time in the
    caller's process, where the fast path runs without a timeout)."""
    stack: list[int] = []
    match: dict[int, int] = {}
    for m in _BRACE_RE.finditer(text):
        if m.group(0) == "{":
            stack.append(m.start())
        elif stack:
            match[stack.pop()] = m.start()
    return match


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces), or None."""
    matches = list(_BOXED_RE.finditer(text))
    closing: Optional[dict[int, int]] = None
    for m in reversed(matches):
        i = m.end()
        if i < len(text) and text[i] == "{":
            if closing is None:
                closing = _closing_braces(text)
            j = closing.get(i)
            if j is not None:
                return text[i + 1:j].strip()
            continue  # unbalanced: try an earlier one
        # "\boxed 5": the next token up to whitespace or "$" (only looked for after a space:
        # "\boxed\frac..." without one must not scan the rest of the text each time).
        if m.group(0).endswith(tuple(" \t")):
            tok = _BOXED_TOKEN_RE.match(text, i)
            if tok:
                return tok.group(0).rstrip(".")
    return None


def _unclosed_box_start(text: str) -> Optional[int]:
    """Start of the first ``\\boxed{`` / ``\\fbox{`` whose brace never closes, or None. All
    text after it lies inside that box: a response truncated mid-box (``\\boxed{\\frac{1}{2``)."""
    closing: Optional[dict[int, int]] = None
    for m in _BOXED_RE.finditer(text):
        i = m.end()
        if i < len(text) and text[i] == "{":
            if closing is None:
                closing = _closing_braces(text)
            if i not in closing:
                return m.start()
    return None


# Scientific notation after a plain number: "1e5", "3.2e-4", "6.02E23" (the exponent is part of
# the number, never the answer on its own; at most 3 digits: Fraction("1e999999") is huge).
_PLAIN = r"-?(?:\d+(?:\.\d*)?|\.\d+)"     # a plain decimal number
_SCI_EXPONENT = r"[eE][+-]?\d{1,3}"
_SCI_EXPONENT_RE = re.compile(_SCI_EXPONENT + r"(?!\d|\.\d)")
_PLAIN_RE = re.compile(rf"^{_PLAIN}$")
_SCI_RE = re.compile(rf"^{_PLAIN}{_SCI_EXPONENT}$")     # 1e5, 3.2e-4


# A proper fraction after a whole number and spaces: "1 1/2 cups" is the mixed number 3/2.
_WHOLE_RE = re.compile(r"-?\d+")
_PROPER_FRACTION_RE = re.compile(r"(\d+)/(\d+)")


def _mixed_with(last: Optional[str], last_end: int, text: str, m: re.Match) -> Optional[str]:
    """``last`` (a whole number ending at ``last_end``) and the fraction ``m`` after it, only
    spaces apart, as one mixed number ("1 1/2"); else None."""
    frac = _PROPER_FRACTION_RE.fullmatch(m.group(0))
    if (last is None or frac is None or not _WHOLE_RE.fullmatch(last)
            or not 0 < int(frac.group(1)) < int(frac.group(2))):
        return None
    gap = text[last_end:m.start()]
    return f"{last} {m.group(0)}" if gap and not gap.strip(" ") else None


def _last_number(text: str) -> Optional[str]:
    last = None
    last_end = -1
    skip_to = 0
    for m in _NUMBER_RE.finditer(text):
        if m.start() < skip_to:         # the exponent of the number before
            continue
        s = m.group(0)
        if _PLAIN_RE.match(s) and (e := _SCI_EXPONENT_RE.match(text, m.end())):
            s += e.group(0)
            skip_to = e.end()
        # An exponent ("12 cm^2", "m^{3}") is not a final answer on its own.
        before = text[max(0, m.start() - 2):m.start()]
        if before.endswith("^") or before == "^{":
            continue
        if _touches_other_number(text, m.start(), m.end()):     # "5①" is not 5
            continue
        # A minus right after a word character or a closing bracket is subtraction, not a sign.
        if s.startswith("-") and m.start() > 0 and (text[m.start() - 1].isalnum()
                                                     or text[m.start() - 1] in ")]}"):
            s = s[1:]
        last = _mixed_with(last, last_end, text, m) or s
        last_end = m.end()
    return last


# A currency sign before a number: the LaTeX dollar (``\$40``), the euro, pound, yen and rupee
# signs (``€50``, ``-£5``), as ``$40`` is.
_CURRENCY_RE = re.compile(r"^(-?)(?:\\\$|[\u20ac\u00a3\u00a5\u20b9])\s*(?=\.?\d)")


_MATH_DELIMITERS = (("\\(", "\\)"), ("\\[", "\\]"))


def _clean(ans: str) -> str:
    """Strip whitespace, surrounding ``$`` or LaTeX math delimiters (``\\(...\\)``,
    ``\\[...\\]``), markdown emphasis (``**42**``) and trailing periods (repeatedly); a ``$``
    after a leading minus goes too (``-$5`` -> ``-5``), and so does another currency sign before
    a number (``\\$40``, ``-\\$5``, ``€50``, ``£1,200``: currency, as in ``$40``)."""
    prev = None
    while ans != prev:
        prev = ans
        ans = _CURRENCY_RE.sub(r"\1", ans.strip().strip("$*").rstrip("."))
        if ans.startswith("-$"):
            ans = "-" + ans[2:]
        for left, right in _MATH_DELIMITERS:
            inner = ans[2:-2]
            if ans.startswith(left) and ans.endswith(right) and len(ans) >= 4 \
                    and left not in inner and right not in inner:    # "\(2\) and \(3\)": kept
                ans = inner
    return ans


def _leading_number(text: str) -> Optional[re.Match]:
    lead = _LEADING_NUMBER_RE.match(text)
    return None if lead is None or _touches_other_number(text, 0, lead.end()) else lead


# A number at the start of an answer fragment ("18 dollars a day for 7 days" -> 18, "2 3/4
# cups" -> 2 3/4), unless an operator follows it ("10 - 2, which is 8": the last number then).
_LEADING_NUMBER_RE = re.compile(r"(-?\d+ +\d+/\d+|" + _NUMBER_RE.pattern + r")(?!\d|[.,/]\d)"
                                r"(?!\s*[-\u2212x\u00d7\u00f7\u00b7]\s*[\d(])")
_MATH_CHARS = "\\^_=+*/()[]{}"
# What may follow "####" as an answer: a number, sign, LaTeX, a bracket, "x = ...". Anything
# else ("#### Step 2: Double it", "#### Final Answer") is a markdown heading, not an answer.
# An expression in a variable ("x^2+1", "-x+1") starts like a value too: a letter, an operator,
# then a digit, bracket, backslash or one letter.
_VALUE_START_RE = re.compile(r"[-\u2212+]?\s*(?:\d|\.\d|\\)|[(\[{]|[A-Za-z]\s*="
                             r"|[-\u2212+]?[A-Za-z]\s*[-+*/^]\s*(?:[\d(\\]|[A-Za-z](?![A-Za-z]))")


# An arithmetic expression of numbers and one-letter variables only ("3 - 2i", "x - 2",
# "3 x 4"): a value, not words around a number.
_TERM = r"\(?(?:\d[\d,]*(?:\.\d+)?[A-Za-z]?|\.\d+|[A-Za-z])\)?"
_EXPRESSION_RE = re.compile(r"[-+]?\s*" + _TERM
                            + r"(?:\s*[-+*/^x\u00d7\u00f7\u00b7]\s*[-+]?" + _TERM + r")+")
# More numbers after a comma, and nothing else: a list ("2, 3"; "1, 2 and 3"), not one number
# with words after it ("12, 5 more than Bob").
_LIST_REST_RE = re.compile(r"\s*[,;]\s*(?:" + _NUMBER_RE.pattern + r")"
                           r"(?:\s*(?:[,;]|,?\s*(?:and|or)\b)\s*(?:" + _NUMBER_RE.pattern
                           + r"))*\s*")


def _fragment_answer(frag: str) -> Optional[str]:
    """The answer in a one-line fragment after ``####`` or "the answer is": the fragment itself
    when it is a number, one token, an arithmetic expression ("3 - 2i") or a list ("2, 3"); its
    leading number when words follow it (lm-eval's and OpenAI's GSM8K graders read the number
    right after the marker); the fragment when it looks like math; else its last number."""
    if parse_number(frag) is not None or " " not in frag or _EXPRESSION_RE.fullmatch(frag):
        return frag
    lead = _leading_number(frag)
    if lead is not None and _LIST_REST_RE.fullmatch(frag, lead.end()):
        return frag
    if lead is not None and not any(c in frag[lead.end():] for c in _MATH_CHARS if c not in "()"):
        return lead.group(1)
    if any(c in frag for c in _MATH_CHARS):
        return frag
    return _last_number(frag)


# "#### 42!": an exclamation after a number, as "The answer is 42!" is (not 42 factorial).
_EXCLAIMED_RE = re.compile(r"(?<=\d)!+\s*$")


def extract_answer(response: str) -> Optional[str]:
    """Final answer text of a response, or None when there is none.

    Order: last ``\\boxed{}``; text after the last ``####`` that starts like a value (a
    number, sign, currency, LaTeX, bracket, ``x =``, or a token of up to 3 characters: ``####
    Step 2: ...`` is a markdown heading), or any text after it when that ends the response
    (``#### Monday``); text after the last "answer is"; the last number in the
    response. A trailing period, surrounding ``$`` and markdown ``**`` are stripped. After
    ``####`` or "answer is", text with words ("5 dollars", "120 minutes, or 2 hours") gives its
    leading number, or its last one when it does not start with one; "answer is" reads only
    its own sentence ("The answer is 7. Check: 7 + 3 = 10" is 7). Text inside a box that never
    closes (a response truncated mid-box) is no answer. A unicode minus is a minus.
    """
    response = _normalize_unicode(response)
    boxed = extract_boxed(response)
    if boxed is not None:
        return _clean(boxed) or None
    cut = _unclosed_box_start(response)
    if cut is not None:  # truncated inside a box: its partial content is not an answer
        response = response[:cut]
    for k, m in enumerate(reversed(list(_GSM8K_RE.finditer(response)))):
        ans = _clean(_EXCLAIMED_RE.sub("", m.group(1)))
        if ans and (_VALUE_START_RE.match(ans) or (len(ans) <= 3 and " " not in ans)):
            return _fragment_answer(ans) or ans
        if ans and k == 0 and not response[m.end():].strip():
            return ans  # words that end the response ("#### Monday"): the answer, no heading
    said = _ANSWER_IS_RE.findall(response)
    if said:
        frag = said[-1]
        inner = _ANSWER_IS_RE.search(frag)  # "Final Answer: The final answer is $x$."
        while inner is not None:
            frag = inner.group(1)
            inner = _ANSWER_IS_RE.search(frag)
        # Its first sentence: "The answer is 7. Check: 7 + 3 = 10" is 7, not 10.
        frag = _SENTENCE_END_RE.split(frag, 1)[0]
        frag = _clean(_clean(frag).rsplit("=", 1)[-1])     # "\(x = 5\)" is 5
        num = _fragment_answer(frag) if frag else None
        if num is not None:
            return num
    num = _last_number(response)
    return _clean(num) if num is not None else None


# A number followed by words only ("18 dollars", "1,000 people", "2 3/4 cups"); not a
# constant or the imaginary unit ("2 pi", "3 i" are values)
_UNIT_WORDS_RE = re.compile(r"\s+(?!(?:pi|i|e)\b)[A-Za-z][A-Za-z .%/-]*")


def gold_answer(gold: str) -> str:
    """Normalize a gold answer: a boxed or ``####`` gold is reduced to its final answer, and a
    number followed by words only ("18 dollars") to the number, as a response's answer is."""
    gold = _normalize_unicode(gold)
    boxed = extract_boxed(gold)
    if boxed is not None:
        return _clean(boxed)
    gsm = [f for f in _GSM8K_RE.findall(gold) if _clean(f)]
    g = _clean(gsm[-1]) if gsm else _clean(gold)
    lead = _leading_number(g)
    if lead is not None and _UNIT_WORDS_RE.fullmatch(g, lead.end()):
        return lead.group(1)
    return g


_INT_COMMAS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
# A comma and a space part a list ("3, 125": two solutions), never thousands ("3,125").
_LIST_COMMA_RE = re.compile(r",\s")
_INT_SPACES_RE = re.compile(r"^-?\d{1,3}(?: \d{3})+(?:\.\d+)?$")
_DIGIT_SPACE_DIGIT_RE = re.compile(r"\d +\d")
_MIXED_RE = re.compile(r"^(-?)(\d+) +(\d+)/(\d+)$")
_RATIO_RE = re.compile(r"^(-?\d+)\s*/\s*(\d+)$")
_FRAC_RE = re.compile(r"^(-?)\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(\d+)\s*\}$")


def parse_number(text: str) -> Optional[Fraction]:
    """Exact rational value of a plain number (``1,000``, ``1 000``, ``-2.5``, ``3/4``,
    ``2 3/4`` (a mixed number), ``\\frac{1}{2}``).

    Returns None for anything else (units, expressions, percent, intervals, digits apart that
    are not thousands groups such as ``3 4``, numbers too long for ``int``, ...).
    """
    s = _clean(_normalize_unicode(text)).replace("\\!", "").replace("\\,", "").replace("{,}", ",")
    if not s or _LIST_COMMA_RE.search(s):
        return None
    try:
        if _DIGIT_SPACE_DIGIT_RE.search(s):
            m = _MIXED_RE.match(s)
            if m:
                whole, num, den = int(m.group(2)), int(m.group(3)), int(m.group(4))
                if not 0 <= num < den:
                    return None
                value = whole + Fraction(num, den)
                return -value if m.group(1) else value
            if not _INT_SPACES_RE.match(s):
                return None
        s = s.replace(" ", "")
        if _INT_COMMAS_RE.match(s):
            s = s.replace(",", "")
        if _PLAIN_RE.match(s) or _SCI_RE.match(s):
            return Fraction(s)
        m = _RATIO_RE.match(s)
        if m:
            num, den = int(m.group(1)), int(m.group(2))
            return Fraction(num, den) if den else None
        m = _FRAC_RE.match(s)
        if m:
            num, den = int(m.group(2)), int(m.group(3))
            if not den:
                return None
            value = Fraction(num, den)
            return -value if m.group(1) else value
    except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
        return None
    return None


def normalize_answer(text: str) -> str:
    """Normalization for string matching: trimmed, lower case, single spaces, no ``$``,
    no trailing period, thousands commas (also LaTeX ``1{,}000``, ``1,\\!000``) removed,
    ``\\text{x}`` -> ``x``, a unicode minus read as ``-``."""
    s = _clean(_normalize_unicode(text)).replace("{,}", ",").replace(",\\!", ",")
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    if _INT_COMMAS_RE.match(s.replace(" ", "")) and not _LIST_COMMA_RE.search(s):
        s = s.replace(",", "")
    return re.sub(r"\s+", " ", s).strip().lower()


# --------------------------------------------------------------------------------------------
# Built-in reward functions
# --------------------------------------------------------------------------------------------

# True while a timer set by this module guards the current call (math-verify must then not arm
# its own SIGALRM: that would cancel ours).
_guard = threading.local()


class _DropTimeoutDisabledWarning(logging.Filter):
    # math-verify warns once per process when its own timeout is off; ours is on instead.
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


_FILTER = _DropTimeoutDisabledWarning()


def _math_verify_timeouts() -> Optional[int]:
    if getattr(_guard, "timer_active", False):
        for name in ("math_verify.parser", "math_verify.grader"):
            lg = logging.getLogger(name)
            if _FILTER not in lg.filters:
                lg.addFilter(_FILTER)
        return None
    if threading.current_thread() is threading.main_thread():
        return 5  # math-verify's own signal timeout
    return None  # signals only work in the main thread; the caller must bound the time


# Two numbers this close may be equal to math-verify (verify's float_rounding=6: both sides
# rounded to 6 decimals when either is a float); farther apart, they never are.
_MV_FLOAT_BAND = Fraction(1, 10**6)


_PERCENT_RE = re.compile(r"^(.*?)\s*\\?%$")


def _percent_number(text: str) -> Optional[Fraction]:
    """The number of a plain number with a percent sign ("12.5%", "12.5\\%"), or None."""
    m = _PERCENT_RE.match(text)
    return parse_number(m.group(1)) if m else None


def math_fast_path(response: str, gold: str) -> Optional[float]:
    """The ``math`` reward when it can be decided without math-verify, else None."""
    pred = extract_answer(response)
    if pred is None:
        return 0.0
    g_text = gold_answer(gold)
    g, p = parse_number(g_text), parse_number(pred)
    # A percent equals its number and its fraction (math-verify's rule, which it keeps for
    # whole numbers only: "50%" was 50 but "12.5%" was not 12.5); other pairs: math-verify's.
    if (g is None) != (p is None):
        pct, num = (_percent_number(g_text), p) if g is None else (_percent_number(pred), g)
        if pct is not None and num in (pct, pct / 100):
            return 1.0
    if g is not None and p is not None:
        if g == p:
            return 1.0
        if abs(g - p) <= _MV_FLOAT_BAND and ("." in g_text or "." in pred):
            # math-verify rounds to 6 decimals when either side is a decimal (0.333333 == 1/3):
            # leave such near misses to it, so the reward does not depend on whether the gold
            # is written as a plain number (\frac{1}{3}) or not (\frac13).
            return None
        return 0.0
    return None


# A number in scientific notation inside an answer ("1.5e3 \\text{ m}", "x = 1e3"): math-verify
# reads its "e" as Euler's number (1.5e3 is 1.5 * e * 3); it is given 1.5 \\times 10^{3}.
_SCI_TOKEN_RE = re.compile(r"(?<![\w.\\])(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d{1,3})(?![\w.])")


def _sci_written_out(text: str) -> str:
    return _SCI_TOKEN_RE.sub(lambda m: f"{m.group(1)} \\times 10^{{{int(m.group(2))}}}", text)


def math_reward(response: str, gold: str) -> float:
    """1.0 if the response's final answer equals the gold answer (see the module doc)."""
    fast = math_fast_path(response, gold)
    if fast is not None:
        return fast
    from math_verify import parse, verify  # sympy-heavy: imported on first slow call

    pred = extract_answer(response)
    g_text = gold_answer(gold)
    if _number_beside_other(g_text) or _number_beside_other(pred):
        # math-verify would drop the "①" of "5①" and read 5: compare the strings instead.
        return 1.0 if normalize_answer(g_text) == normalize_answer(pred) else 0.0
    t = _math_verify_timeouts()
    g_parsed = parse(f"${_sci_written_out(g_text)}$", parsing_timeout=t)
    p_parsed = parse(f"${_sci_written_out(pred)}$", parsing_timeout=t)
    if not g_parsed or not p_parsed:
        # Fall back to string equality of the normalized answers.
        return 1.0 if normalize_answer(g_text) == normalize_answer(pred) else 0.0
    return 1.0 if verify(g_parsed, p_parsed, timeout_seconds=t) else 0.0


def exact_reward(response: str, gold: str) -> float:
    """1.0 if the normalized final answer (whole response if none) equals the normalized gold."""
    pred = extract_answer(response)
    pred = response if pred is None else pred
    return 1.0 if normalize_answer(pred) == normalize_answer(gold_answer(gold)) else 0.0


def numeric_closeness_reward(response: str, gold: str, *, scale: Optional[float] = None) -> float:
    """Continuous reward ``exp(-|pred - gold| / scale)``; ``scale`` defaults to
    ``max(|gold|, 1)``. 0.0 when either side is not a plain number."""
    pred = extract_answer(response)
    g = parse_number(gold_answer(gold))
    p = parse_number(pred) if pred is not None else None
    if g is None or p is None:
        return 0.0
    try:
        if scale is None:
            x = float(abs(p - g) / max(abs(g), 1))  # exact: huge numbers do not overflow first
        else:
            x = float(abs(p - g)) / float(scale)
    except OverflowError:  # a distance beyond float range: exp(-x) is 0
        return 0.0
    return math.exp(-x)


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """A registered reward.

    fn: the reward, ``(response, gold) -> float``; must be a module-level function to run in a
        process pool.
    fast_path: optional cheap check run in the calling process; returns the reward, or None to
        defer to ``fn``.
    in_process: run ``fn`` in the calling process even when a pool exists (cheap functions).
    """

    name: str
    fn: RewardFn
    fast_path: Optional[FastPathFn] = None
    in_process: bool = False


_REGISTRY: dict[str, RewardSpec] = {}


def register_reward(name: str, *, fast_path: Optional[FastPathFn] = None,
                    in_process: bool = False, overwrite: bool = False):
    """Decorator registering ``fn(response, gold) -> float`` under ``name``; returns ``fn``."""
    if not isinstance(name, str) or not name:
        # a bare ``@register_reward`` passes the function as the name: nothing registered,
        # and the user's function replaced by the decorator
        raise TypeError(f"register_reward takes the reward's name first: use "
                        f"@register_reward(\"name\") (got {name!r})")

    def decorator(fn: RewardFn) -> RewardFn:
        if not callable(fn):    # every item would score 0 as an error, the run going on
            raise TypeError(f"reward {name!r}: register a callable (response, gold) -> float, "
                            f"not {fn!r}")
        old = _REGISTRY.get(name)
        # a module re-import registers a function of the same module and qualname again; not
        # a lambda, a closure, a class instance or a partial (others of one name are no copy)
        qualname = getattr(fn, "__qualname__", None)
        same = old is not None and (old.fn is fn or (
            isinstance(qualname, str) and "<" not in qualname
            and getattr(old.fn, "__module__", None) == getattr(fn, "__module__", None)
            and getattr(old.fn, "__qualname__", None) == qualname))
        if old is not None and not overwrite and not same:
            raise ValueError(f"reward {name!r} is already registered ({_where(old.fn)}); pass "
                             f"overwrite=True to replace it")
        _REGISTRY[name] = RewardSpec(name, fn, fast_path, in_process)
        return fn

    return decorator


def _where(fn) -> str:
    """``module.qualname`` of a reward (a class instance or a partial: its repr)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}.{qualname}" if isinstance(qualname, str) else repr(fn)


# what an unknown reward name is, most often: one registered by a user's code the CLI never ran
UNKNOWN_REWARD_HINT = ("(a reward of your own is registered by your code with "
                       "hacpo.engine.rewards.register_reward: the hacpo command imports none, "
                       "so train / evaluate such a run through the Python API)")


def get_reward_spec(name: str) -> RewardSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown reward {name!r}; registered: {sorted(_REGISTRY)} "
                       f"{UNKNOWN_REWARD_HINT}") from None


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered under ``name`` (KeyError listing the known names)."""
    return get_reward_spec(name).fn


def list_rewards() -> list[str]:
    return sorted(_REGISTRY)


register_reward("math", fast_path=math_fast_path)(math_reward)
register_reward("exact", in_process=True)(exact_reward)
register_reward("numeric_closeness", in_process=True)(numeric_closeness_reward)
# the built-in rewards read the gold answer as text: a gold that is none is an error
_TEXT_GOLD_REWARDS = (math_reward, exact_reward, numeric_closeness_reward)


# --------------------------------------------------------------------------------------------
# Running one item under a timeout (in a pool worker or in-process)
# --------------------------------------------------------------------------------------------

class _RewardTimeout(BaseException):
    """Raised by our SIGALRM handler. A BaseException so `except Exception` in user code or in
    math-verify does not swallow it."""


def _on_alarm(signum, frame):
    if getattr(_guard, "timer_active", False):
        raise _RewardTimeout()


def _call_guarded(fn: RewardFn, response: str, gold: str, timeout_s: Optional[float]):
    """Run ``fn`` and return ``("ok", value) | ("error", message) | ("timeout", message)``.

    The timeout uses SIGALRM and so applies only in the main thread; elsewhere ``fn`` runs
    unguarded (the pool's parent-side deadline still applies to pool workers). A timer of the
    caller's (``signal.alarm`` / ``ITIMER_REAL``: a notebook's or a sweep's watchdog; a process
    has one) is put back after the call with what is left of it; one due during the call fires
    as it returns.

    A SystemExit or KeyboardInterrupt propagates: hacpo's SIGTERM handler stops a run with
    SystemExit(143), raised wherever the main thread is (often in here); a reward of one's own
    that calls ``sys.exit`` stops an in-process caller too (in a pool worker it scores 0).
    """
    use_timer = bool(timeout_s) and threading.current_thread() is threading.main_thread()
    old_handler = None
    if use_timer:
        old_handler = signal.signal(signal.SIGALRM, _on_alarm)
        _guard.timer_active = True
        start = time.monotonic()
        caller_delay, caller_interval = signal.setitimer(signal.ITIMER_REAL, float(timeout_s))
    try:
        return "ok", fn(response, gold)
    except _RewardTimeout:
        return "timeout", f"timed out after {timeout_s} s"
    except Exception as e:  # a failing reward scores 0, counted by the caller
        return "error", f"{type(e).__name__}: {e}"
    finally:
        if use_timer:
            _guard.timer_active = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_handler)
            if caller_delay > 0:
                left = caller_delay - (time.monotonic() - start)
                signal.setitimer(signal.ITIMER_REAL, max(left, 1e-6), caller_interval)


def _call_in_worker(fn: RewardFn, response: str, gold: str, timeout_s: Optional[float]):
    """``_call_guarded`` in a pool worker; ``("unsent", why)`` for a value that does not pickle
    (no number: the caller refuses it as one returned in-process, not a reward error)."""
    status, value = _call_guarded(fn, response, gold, timeout_s)
    if status == "ok":
        try:
            pickle.dumps(value)
        except Exception as e:
            return "unsent", f"{type(e).__name__}: {e}"
    return status, value


def _worker_init() -> None:
    # Ctrl-C in a terminal signals the whole process group: the trainer unwinds and stops its
    # workers, which must not print a KeyboardInterrupt traceback of their own. SIGINT was
    # blocked since the worker's birth (_launching_workers), so one sent while it started is
    # dropped here.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    # Warm the heavy import once per worker so the first item's timeout is not spent on it.
    try:
        import math_verify  # noqa: F401
    except ImportError:
        pass
    # A parent that dies without stopping its pool (kill -9, an OOM kill, a notebook kernel
    # restart) leaves its workers to init: each ends itself once its parent is gone.
    parent = os.getppid()

    def _watch_parent() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)
    threading.Thread(target=_watch_parent, name="hacpo-parent-watch", daemon=True).start()


def _ping(reward: Optional[bytes] = None) -> Optional[str]:
    """A worker's start-up call: ``reward`` (the pickled reward function) is unpickled here,
    i.e. its module imported; returns why that failed, or None. A reward no worker can load
    then fails the pool's start with that reason, not every item with a broken pool."""
    if reward is None:
        return None
    try:
        pickle.loads(reward)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


@contextlib.contextmanager
def _launching_workers():
    """Spawn worker processes inside this: a Ctrl-C or SIGTERM arriving meanwhile is raised
    once the spawns are done, not halfway through one (the child would then read a truncated
    start-up message and print an EOFError traceback), and the children are born with SIGINT
    blocked, so a terminal's Ctrl-C reaching them before their initializer runs is dropped
    there instead of raising in the middle of their start-up.

    Main thread only (where Python runs signal handlers); elsewhere it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with signals_deferred(signal.SIGINT, signal.SIGTERM):
        # Starting multiprocessing's resource tracker unblocks SIGINT in this thread (its own
        # block/unblock around the spawn): start it first, so the mask holds for the workers.
        from multiprocessing import resource_tracker
        resource_tracker.ensure_running()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
        finally:      # a SIGINT pending meanwhile is caught now, and raised past the spawns
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


# --------------------------------------------------------------------------------------------
# Batch scorer
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class RewardStats:
    """Counts for one ``score`` call (or accumulated with ``+=``)."""

    total: int = 0
    fast_path: int = 0       # decided by the fast path in the calling process
    slow_path: int = 0       # ran the full reward function
    errors: int = 0          # the reward function raised -> 0.0
    timeouts: int = 0        # the reward function ran past timeout_s -> 0.0
    pool_restarts: int = 0   # pools replaced because a worker hung or died
    seconds: float = 0.0
    failures: list = dataclasses.field(default_factory=list)  # (index, message), first few

    MAX_FAILURES_KEPT = 20

    def note_failure(self, index: int, message: str) -> None:
        if len(self.failures) < self.MAX_FAILURES_KEPT:
            self.failures.append((index, message))

    def __iadd__(self, other: "RewardStats") -> "RewardStats":
        for f in ("total", "fast_path", "slow_path", "errors", "timeouts", "pool_restarts",
                  "seconds"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for item in other.failures:
            self.note_failure(*item)
        return self

    def as_dict(self) -> dict:
        """Scalar counts, e.g. for a metrics logger."""
        return {f: getattr(self, f) for f in ("total", "fast_path", "slow_path", "errors",
                                              "timeouts", "pool_restarts", "seconds")}


class _Unsent:
    """What a reward returned in a worker that could not be sent back (no number: a
    generator, a lambda...), for ``_validate`` to refuse as one returned in-process is."""

    def __init__(self, why: str):
        self.why = why

    def __repr__(self) -> str:
        return f"a value its worker process could not send back ({self.why})"


def _item_error(index: int, message: str) -> ValueError:
    """A ValueError about item ``index`` of a batch, which it holds as ``item`` (a caller names
    the item's prompt and agent by it: the message may hold other numbers, e.g. the value)."""
    err = ValueError(message)
    err.item = index
    return err


class RewardComputer:
    """Scores batches with one registered reward.

    name: a registered reward (``math``, ``exact``, ``numeric_closeness`` or your own).
    num_workers: processes for the slow path; 0 runs it in-process (main thread: SIGALRM
        timeout; another thread: no timeout).
    timeout_s: per-item limit for the slow path.
    mp_context: ``"spawn"`` (default) or ``"forkserver"``. Never fork: the trainer holds
        threads (and possibly CUDA) that a fork would copy.
    hard_timeout_s: parent-side deadline per item before the pool is replaced; default
        ``timeout_s + max(1.0, timeout_s)``.
    startup_timeout_s: limit for starting (and warming) the pool's workers.

    Use as a context manager, or call ``close()``: no worker process outlives it.
    """

    def __init__(self, name: "str | RewardSpec" = "math", num_workers: int = 0,
                 timeout_s: float = 5.0, *, mp_context: str = "spawn",
                 hard_timeout_s: Optional[float] = None, startup_timeout_s: float = 120.0):
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(f"mp_context must be 'spawn' or 'forkserver', got {mp_context!r}")
        # a RewardSpec itself: one registered in another process (a Ray trainer actor scores
        # with the driver's reward, which its own registry may not hold)
        self.spec = name if isinstance(name, RewardSpec) else get_reward_spec(name)
        self.name = self.spec.name
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.hard_timeout_s = (self.timeout_s + max(1.0, self.timeout_s)
                               if hard_timeout_s is None else float(hard_timeout_s))
        self.startup_timeout_s = startup_timeout_s
        self.mp_context = mp_context
        self._pool: Optional[cf.ProcessPoolExecutor] = None
        self._closed = False
        self._warned_thread = False
        if num_workers > 0 and not self.spec.in_process:
            try:
                pickle.dumps(self.spec.fn)
            except Exception as e:
                raise TypeError(
                    f"reward {name!r} cannot be sent to a process pool ({e}); register a "
                    "module-level function, or use num_workers=0 or in_process=True") from e

    # -- pool management --------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker pool now (a no-op without workers): a reward the workers cannot
        load is then an error before a run's warm-up, not at its first scoring."""
        if self.num_workers > 0 and not self.spec.in_process:
            self._get_pool()

    def _get_pool(self) -> cf.ProcessPoolExecutor:
        if self._closed:
            raise RuntimeError("RewardComputer is closed")
        if self._pool is None:
            pool = None
            try:
                # Start every worker now so that start-up is not charged to an item's
                # deadline (the spawns happen in submit()).
                with _launching_workers():
                    pool = cf.ProcessPoolExecutor(
                        max_workers=self.num_workers,
                        mp_context=multiprocessing.get_context(self.mp_context),
                        initializer=_worker_init)
                    blob = pickle.dumps(self.spec.fn) if not self.spec.in_process else None
                    pings = [pool.submit(_ping, blob) for _ in range(self.num_workers)]
                done, not_done = cf.wait(pings, timeout=self.startup_timeout_s)
            except BaseException:       # interrupted: no half-started worker left behind
                if pool is not None:
                    self._kill(pool)
                raise
            errors = [f.exception() for f in done if f.exception() is not None]
            unloadable = [f.result() for f in done if f.exception() is None and f.result()]
            if not_done or errors or unloadable:
                self._kill(pool)
                if unloadable:     # the reward itself: its module not importable there
                    fn = self.spec.fn
                    where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
                    raise ValueError(
                        f"reward {self.name!r} ({where}) cannot be loaded in a reward worker "
                        f"process ({unloadable[0]}): a worker imports the reward's module, so "
                        f"one defined in __main__ (python -c, a notebook) cannot run there: "
                        f"define it in an importable module, or set reward.num_workers=0")
                why = (f"a worker failed: {errors[0]!r}" if errors
                       else f"not ready within {self.startup_timeout_s} s")
                if getattr(self.spec.fn, "__module__", None) == "__main__":
                    # a spawned worker imports the script again: its unguarded train() ran
                    # there too (and failed, e.g. on the run dir's lock)
                    why += (f"; reward {self.name!r} is defined in the script run as __main__, "
                            f"which each worker process imports again: put the script's "
                            f"train() / evaluation call under `if __name__ == \"__main__\":`")
                raise RuntimeError(f"reward worker pool ({self.mp_context}) did not start: {why}")
            self._pool = pool
        return self._pool

    @staticmethod
    def _kill(pool: cf.ProcessPoolExecutor) -> None:
        kill = getattr(pool, "kill_workers", None)  # Python >= 3.14
        procs = list((getattr(pool, "_processes", None) or {}).values())
        if kill is not None:
            kill()
        else:
            for p in procs:
                if p.is_alive():
                    p.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            p.join(timeout=5)

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        self._closed = True
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "RewardComputer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if self._pool is not None:
                self._kill(self._pool)
        except Exception:
            pass

    # -- scoring -----------------------------------------------------------------------------

    def score(self, responses: Sequence[str], golds: Sequence[str]
              ) -> tuple[list[float], RewardStats]:
        """Rewards for ``responses[i]`` against ``golds[i]``, and the call's stats.

        Raises ValueError naming the index of any reward that is not a finite number in [0, 1].
        """
        if len(responses) != len(golds):
            raise ValueError(f"{len(responses)} responses but {len(golds)} gold answers")
        if self.spec.fn in _TEXT_GOLD_REWARDS:
            for i, gold in enumerate(golds):
                if not isinstance(gold, str) or not gold.strip():
                    # not a reward of 0 counted as an error (an int gold scored 0 always)
                    raise _item_error(i, f"reward {self.name!r}: the gold answer of item {i} "
                                         f"is {gold!r} ({type(gold).__name__}), not a non-empty "
                                         f"string")
        t0 = time.perf_counter()
        stats = RewardStats(total=len(responses))
        raw: list = [None] * len(responses)
        slow: list[int] = []
        for i, (resp, gold) in enumerate(zip(responses, golds)):
            if self.spec.fast_path is not None:
                status, value = _call_guarded(self.spec.fast_path, resp, gold, None)
                if status != "ok":
                    self._fail(stats, i, status, value, raw)
                    continue
                if value is not None:
                    raw[i] = value
                    stats.fast_path += 1
                    continue
            slow.append(i)
        stats.slow_path = len(slow)
        if slow:
            if self.num_workers == 0 or self.spec.in_process:
                self._score_in_process(slow, responses, golds, raw, stats)
            else:
                self._score_in_pool(slow, responses, golds, raw, stats)
        rewards = [self._validate(i, v) for i, v in enumerate(raw)]
        stats.seconds = time.perf_counter() - t0
        if stats.errors or stats.timeouts:
            logger.warning("reward %r: %d errors, %d timeouts, %d pool restarts out of %d; "
                           "first: %s", self.name, stats.errors, stats.timeouts,
                           stats.pool_restarts, stats.total, stats.failures[:1])
        return rewards, stats

    def _validate(self, index: int, value) -> float:
        try:
            if isinstance(value, str):
                raise TypeError
            r = float(value)
        except OverflowError:       # an int beyond float range: out of [0, 1]
            r = math.inf
        except (TypeError, ValueError):
            raise _item_error(index, f"reward {self.name!r} returned {value!r} for item "
                                     f"{index}: not a number") from None
        if not math.isfinite(r) or r < 0.0 or r > 1.0:
            raise _item_error(index, f"reward {self.name!r} returned {r!r} for item {index}: "
                                     "rewards must be finite and in [0, 1]")
        return r

    @staticmethod
    def _fail(stats: RewardStats, i: int, status: str, message: str, raw: list) -> None:
        raw[i] = 0.0
        if status == "timeout":
            stats.timeouts += 1
        else:
            stats.errors += 1
        stats.note_failure(i, f"{status}: {message}")

    def _score_in_process(self, idx, responses, golds, raw, stats) -> None:
        if threading.current_thread() is not threading.main_thread() and not self._warned_thread:
            logger.warning("RewardComputer(num_workers=0) called outside the main thread: "
                           "reward timeouts (SIGALRM) are disabled")
            self._warned_thread = True
        for i in idx:
            status, value = _call_guarded(self.spec.fn, responses[i], golds[i], self.timeout_s)
            if status == "ok":
                raw[i] = value
            else:
                self._fail(stats, i, status, value, raw)

    def _score_in_pool(self, idx, responses, golds, raw, stats) -> None:
        # At most num_workers items in flight, so submission time ~ start time and each item
        # gets its own deadline. A worker that dies (a reward calling os._exit, a segfault in
        # a C extension) breaks the whole pool: every item in flight fails with it, and which
        # one killed its worker is unknown. Those are re-run one at a time ("suspects", alone
        # in the pool): the one that breaks it alone scores 0 as an error, the others count.
        pending = collections.deque(idx)
        suspects: collections.deque[int] = collections.deque()
        inflight: dict[cf.Future, tuple[int, float]] = {}
        fn = self.spec.fn
        while pending or suspects or inflight:
            pool = self._get_pool()
            if suspects:
                if not inflight:
                    i = suspects.popleft()
                    fut = pool.submit(_call_in_worker, fn, responses[i], golds[i], self.timeout_s)
                    inflight[fut] = (i, time.monotonic())
            else:
                while pending and len(inflight) < self.num_workers:
                    i = pending.popleft()
                    fut = pool.submit(_call_in_worker, fn, responses[i], golds[i], self.timeout_s)
                    inflight[fut] = (i, time.monotonic())
            next_deadline = min(t for _, t in inflight.values()) + self.hard_timeout_s
            done, _ = cf.wait(list(inflight), timeout=max(0.0, next_deadline - time.monotonic()),
                              return_when=cf.FIRST_COMPLETED)
            alone = len(inflight) == 1
            broken: list[tuple[int, BaseException]] = []
            for fut in done:
                i, _ = inflight.pop(fut)
                exc = fut.exception()
                if exc is None:
                    status, value = fut.result()
                    if status in ("ok", "unsent"):
                        raw[i] = _Unsent(value) if status == "unsent" else value
                    else:
                        self._fail(stats, i, status, value, raw)
                elif isinstance(exc, cf.process.BrokenProcessPool):   # a worker died
                    broken.append((i, exc))
                else:  # the result did not unpickle
                    self._fail(stats, i, "error", f"{type(exc).__name__}: {exc}", raw)
            now = time.monotonic()
            expired = [f for f, (_, t) in inflight.items() if now - t >= self.hard_timeout_s]
            for fut in expired:
                i, _ = inflight.pop(fut)
                self._fail(stats, i, "timeout",
                           f"worker did not answer within {self.hard_timeout_s} s", raw)
            if expired or broken:
                # Replace the pool; items still in flight are re-run on the new one.
                for fut, (i, _) in list(inflight.items()):
                    (suspects if broken else pending).appendleft(i)
                inflight.clear()
                if alone and broken:     # it ran alone: it killed its worker
                    i, exc = broken[0]
                    self._fail(stats, i, "error", f"the reward's worker process died scoring "
                               f"it ({type(exc).__name__}: {exc})", raw)
                else:
                    suspects.extend(i for i, _ in broken)
                stats.pool_restarts += 1
                pool, self._pool = self._pool, None
                self._kill(pool)
