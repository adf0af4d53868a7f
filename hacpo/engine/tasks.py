"""An embedded procedural task: multi-step arithmetic word problems with exact integer answers.

Needs no download, so it is the default training data. The vocabulary is small and regular
(a few names, objects and sentence patterns) so that tiny models with a character tokenizer
can learn it::

    Tom has 3 apples. He gets 4 more. Then he gives away 2. How many apples does Tom have?
    -> answer "5", reference solution "3+4=7, 7-2=5. #### 5"

Operations apply left to right. Difficulty presets: ``easy`` (2 steps, operands 1-9, + -),
``medium`` (2-3 steps, operands up to 20, + -), ``hard`` (3-4 steps, operands up to 50, + - *).
Intermediate results never go negative unless ``allow_negative=True``.

Train and held-out splits come from disjoint random streams *and* a hash partition of the
problem's arithmetic (start value and steps): a problem whose hash falls in the held-out
bucket is never generated for training and vice versa, so they cannot overlap.
"""
from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from typing import Sequence

from hacpo.engine.data import Example

__all__ = ["ArithmeticTask", "DIFFICULTIES", "WORDINGS", "reference_solution", "parse_problem",
           "solve_steps"]

WORDINGS = ("word", "symbolic")     # data.wording
DIFFICULTIES: dict[str, dict] = {
    "easy": dict(num_steps=(2, 2), max_operand=9, ops="+-"),
    "medium": dict(num_steps=(2, 3), max_operand=20, ops="+-"),
    "hard": dict(num_steps=(3, 4), max_operand=50, ops="+-*"),
}

_NAMES = (("Tom", "he"), ("Ann", "she"), ("Sam", "he"), ("Mia", "she"), ("Ben", "he"),
          ("Eva", "she"))
_OBJECTS = ("apples", "books", "coins", "cards", "pens", "eggs")
_MAX_MULTIPLIER = 5  # keeps products small: "*" draws from 2..min(max_operand, 5)
_HELDOUT_BUCKETS = 5  # 1 in 5 problems (by hash) belongs to the held-out side

Step = tuple[str, int]


def solve_steps(start: int, steps: Sequence[Step]) -> list[int]:
    """Running values after each step (left to right)."""
    values, cur = [], start
    for op, b in steps:
        cur = cur + b if op == "+" else cur - b if op == "-" else cur * b
        values.append(cur)
    return values


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """Generator of arithmetic problems.

    num_steps: (min, max) number of operations after the start value (inclusive).
    max_operand: operands are drawn from 1..max_operand (the start value from 2, and
        multipliers from 2..min(max_operand, 5)).
    ops: a subset of ``"+-*"``.
    wording: ``"word"`` (sentences) or ``"symbolic"`` (``"3+4-2=?"``).
    seed: the task seed; splits are deterministic functions of it.
    allow_negative: allow intermediate results below zero.
    """

    num_steps: tuple[int, int] = (2, 3)
    max_operand: int = 9
    ops: str = "+-"
    wording: str = "word"
    seed: int = 0
    allow_negative: bool = False

    def __post_init__(self):
        lo, hi = self.num_steps
        if not 1 <= lo <= hi:
            raise ValueError(f"num_steps must be (min, max) with 1 <= min <= max, "
                             f"got {self.num_steps}")
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"ops must be a non-empty subset of '+-*', got {self.ops!r}")
        if self.wording not in WORDINGS:
            raise ValueError(f"wording must be 'word' or 'symbolic', got {self.wording!r}")

    @classmethod
    def from_difficulty(cls, level: str, **overrides) -> "ArithmeticTask":
        """A preset (``easy``/``medium``/``hard``) with optional field overrides."""
        try:
            kwargs = dict(DIFFICULTIES[level])
        except KeyError:
            raise KeyError(f"unknown difficulty {level!r}; known: {sorted(DIFFICULTIES)}") \
                from None
        kwargs.update(overrides)
        return cls(**kwargs)

    # -- generation --------------------------------------------------------------------------

    def _sample(self, rng: random.Random) -> tuple[int, list[Step]]:
        start = rng.randint(min(2, self.max_operand), self.max_operand)
        cur, steps = start, []
        for _ in range(rng.randint(*self.num_steps)):
            ops = list(self.ops)
            if not self.allow_negative and cur < 1 and len(ops) > 1:
                ops = [o for o in ops if o != "-"] or ops
            op = rng.choice(ops)
            if op == "+":
                b = rng.randint(1, self.max_operand)
            elif op == "-":
                hi = self.max_operand if self.allow_negative else min(self.max_operand, cur)
                b = rng.randint(1, hi) if hi >= 1 else 0
            else:
                b = rng.randint(2, max(2, min(self.max_operand, _MAX_MULTIPLIER)))
            steps.append((op, b))
            cur = solve_steps(cur, [(op, b)])[0]
        return start, steps

    def _render(self, start: int, steps: Sequence[Step], rng: random.Random) -> str:
        if self.wording == "symbolic":
            return _symbolic_expression(start, steps) + "=?"
        name, pron = rng.choice(_NAMES)
        obj = rng.choice(_OBJECTS)
        parts = [f"{name} has {start} {obj}."]
        for k, (op, b) in enumerate(steps):
            subject = pron.capitalize() if k == 0 else f"Then {pron}"
            if op == "+":
                parts.append(f"{subject} gets {b} more.")
            elif op == "-":
                parts.append(f"{subject} gives away {b}.")
            else:
                parts.append(f"{subject} has {b} times as many.")
        parts.append(f"How many {obj} does {name} have?")
        return " ".join(parts)

    @staticmethod
    def _bucket(start: int, steps: Sequence[Step]) -> int:
        key = f"{start}|" + "|".join(f"{op}{b}" for op, b in steps)
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % _HELDOUT_BUCKETS

    def _split(self, n: int, split: str) -> list[Example]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = random.Random(f"hacpo.ArithmeticTask:{split}:{self.seed}")
        want_heldout = split == "heldout"
        out: list[Example] = []
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 1000 * (n + 10):
                raise RuntimeError(f"cannot draw {n} {split} problems from {self}")
            start, steps = self._sample(rng)
            if (self._bucket(start, steps) == 0) != want_heldout:
                continue
            prompt = self._render(start, steps, rng)
            answer = solve_steps(start, steps)[-1]
            out.append(Example(id=f"arith-{split}-{self.seed}-{len(out)}", prompt=prompt,
                               answer=str(answer), source=f"arithmetic/{split}"))
        return out

    def train_split(self, n: int) -> list[Example]:
        """``n`` training problems (duplicates possible on tiny settings)."""
        return self._split(n, "train")

    def heldout_split(self, n: int) -> list[Example]:
        """``n`` held-out problems; none shares its arithmetic (hence its text) with training.
        Independent draws, so repeats are possible (the easy task's 500: 221 distinct sums,
        small starting values favoured), as in the training split."""
        return self._split(n, "heldout")


def _symbolic_expression(start: int, steps: Sequence[Step]) -> str:
    expr = str(start)
    for op, b in steps:
        if op == "*" and ("+" in expr or "-" in expr[1:]):
            expr = f"({expr})*{b}"
        else:
            expr = f"{expr}{op}{b}"
    return expr


_WORD_START = re.compile(r"^\w+ has (\d+) \w+\.")
_WORD_STEP = re.compile(r"(?:He|She|Then he|Then she) (gets (\d+) more|gives away (\d+)|"
                        r"has (\d+) times as many)\.")
_SYM_TOKEN = re.compile(r"([+\-*])(\d+)")


def parse_problem(prompt: str) -> tuple[int, list[Step]]:
    """Start value and steps of a problem produced by :class:`ArithmeticTask`."""
    m = _WORD_START.match(prompt)
    if m:
        steps: list[Step] = []
        for s in _WORD_STEP.finditer(prompt):
            if s.group(2):
                steps.append(("+", int(s.group(2))))
            elif s.group(3):
                steps.append(("-", int(s.group(3))))
            else:
                steps.append(("*", int(s.group(4))))
        return int(m.group(1)), steps
    expr = prompt.strip()
    if expr.endswith("=?"):
        flat = expr[:-2].replace("(", "").replace(")", "")
        head = re.match(r"^\d+", flat)
        if head:
            return int(head.group(0)), [(op, int(b)) for op, b in
                                        _SYM_TOKEN.findall(flat[head.end():])]
    raise ValueError(f"not an ArithmeticTask problem: {prompt!r}")


def reference_solution(example: Example) -> str:
    """A short worked answer ending in ``#### <answer>``, e.g. ``"3+4=7, 7-2=5. #### 5"``."""
    start, steps = parse_problem(example.prompt)
    values = solve_steps(start, steps)
    parts, cur = [], start
    for (op, b), v in zip(steps, values):
        parts.append(f"{cur}{op}{b}={v}")
        cur = v
    return f"{', '.join(parts)}. #### {values[-1]}"
