"""The embedded arithmetic task: determinism, correct answers, disjoint splits, references."""
import re

import pytest

from hacpo.engine.data import Example
from hacpo.engine.rewards import RewardComputer, math_reward
from hacpo.engine.tasks import DIFFICULTIES, ArithmeticTask, reference_solution


def _evaluate_words(prompt: str) -> tuple[int, list[int]]:
    """Independent reading of a word problem: answer and every intermediate value."""
    sentences = [s.strip() for s in prompt.split(".") if s.strip()]
    value = int(re.fullmatch(r"[A-Z][a-z]+ has (\d+) [a-z]+", sentences[0]).group(1))
    history = [value]
    for s in sentences[1:]:
        s = s.removeprefix("Then ")
        if s.startswith("How many"):
            break
        words = s.split()
        if words[1:2] == ["gets"] and words[-1] == "more":
            value += int(words[2])
        elif words[1:3] == ["gives", "away"]:
            value -= int(words[3])
        elif words[1:2] == ["has"] and words[-3:] == ["times", "as", "many"]:
            value *= int(words[2])
        else:
            raise AssertionError(f"unexpected sentence {s!r}")
        history.append(value)
    return value, history


def _evaluate_symbolic(prompt: str) -> int:
    assert prompt.endswith("=?") and re.fullmatch(r"[\d+\-*()]+", prompt[:-2])
    return eval(prompt[:-2])  # only digits, operators and parentheses (checked above)


@pytest.mark.parametrize("level", sorted(DIFFICULTIES))
def test_answers_are_correct_and_non_negative(level):
    task = ArithmeticTask.from_difficulty(level, seed=1)
    lo, hi = DIFFICULTIES[level]["num_steps"]
    max_op = DIFFICULTIES[level]["max_operand"]
    for ex in task.train_split(200):
        value, history = _evaluate_words(ex.prompt)
        assert ex.answer == str(value)
        assert min(history) >= 0
        assert lo <= len(history) - 1 <= hi
        assert all(int(n) <= max_op for n in re.findall(r"\d+", ex.prompt))
    sym = ArithmeticTask.from_difficulty(level, seed=1, wording="symbolic")
    for ex in sym.train_split(200):
        assert ex.answer == str(_evaluate_symbolic(ex.prompt))


def test_easy_is_two_one_digit_steps_with_small_vocabulary():
    exs = ArithmeticTask.from_difficulty("easy").train_split(300)
    words = set()
    for ex in exs:
        nums = re.findall(r"\d+", ex.prompt)
        assert len(nums) == 3 and all(len(n) == 1 for n in nums)
        words.update(re.findall(r"[A-Za-z]+", ex.prompt))
    assert len(words) < 40
    assert len({ex.prompt for ex in exs}) > 100  # but many distinct problems


def test_allow_negative_and_multiplication():
    task = ArithmeticTask(num_steps=(3, 3), max_operand=9, ops="-", allow_negative=True, seed=2)
    answers = [int(ex.answer) for ex in task.train_split(50)]
    assert min(answers) < 0
    assert all(int(ex.answer) == _evaluate_words(ex.prompt)[0] for ex in task.train_split(50))
    mul = ArithmeticTask(num_steps=(2, 2), ops="*", wording="symbolic", seed=0)
    assert all("*" in ex.prompt for ex in mul.train_split(20))


def test_deterministic_from_seed():
    a = ArithmeticTask.from_difficulty("medium", seed=5)
    b = ArithmeticTask.from_difficulty("medium", seed=5)
    assert a.train_split(50) == b.train_split(50)
    assert a.heldout_split(20) == b.heldout_split(20)
    assert a.train_split(10) == a.train_split(50)[:10]  # a prefix: n does not change the stream
    c = ArithmeticTask.from_difficulty("medium", seed=6)
    assert [e.prompt for e in c.train_split(50)] != [e.prompt for e in a.train_split(50)]


@pytest.mark.parametrize("level", sorted(DIFFICULTIES))
def test_train_and_heldout_never_overlap(level):
    for wording in ("word", "symbolic"):
        task = ArithmeticTask.from_difficulty(level, seed=0, wording=wording)
        train = {e.prompt for e in task.train_split(2000)}
        held = {e.prompt for e in task.heldout_split(300)}
        assert len(held) > 50
        assert not train & held
        # Not even the same arithmetic under a different name or object.
        numbers = lambda p: tuple(re.findall(r"\d+|gets|gives|has|[+\-*]", p))  # noqa: E731
        assert not {numbers(p) for p in train} & {numbers(p) for p in held}


def test_reference_solutions_score_one():
    exs = []
    for level in DIFFICULTIES:
        for wording in ("word", "symbolic"):
            exs += ArithmeticTask.from_difficulty(level, wording=wording, seed=3).train_split(30)
    exs += ArithmeticTask(ops="+-*", allow_negative=True, seed=4).heldout_split(30)
    refs = [reference_solution(e) for e in exs]
    assert refs[0].endswith(f"#### {exs[0].answer}")
    assert all(re.fullmatch(r"(-?\d+[+\-*]\d+=-?\d+)(, -?\d+[+\-*]\d+=-?\d+)*\. #### -?\d+", r)
               for r in refs)
    with RewardComputer("math", num_workers=0) as rc:
        rewards, stats = rc.score(refs, [e.answer for e in exs])
    assert rewards == [1.0] * len(exs)
    assert stats.fast_path == len(exs)  # integers: never needs math-verify
    # and a wrong final answer scores 0
    wrong = refs[0].rsplit("#### ", 1)[0] + f"#### {int(exs[0].answer) + 1}"
    assert math_reward(wrong, exs[0].answer) == 0.0


def test_reference_solution_example_from_brief():
    ex = Example(id="x", prompt="Tom has 3 apples. He gets 4 more. Then he gives away 2. "
                 "How many apples does Tom have?", answer="5", source="t")
    assert _evaluate_words(ex.prompt)[0] == 5
    assert reference_solution(ex) == "3+4=7, 7-2=5. #### 5"


def test_invalid_settings():
    with pytest.raises(ValueError):
        ArithmeticTask(ops="/")
    with pytest.raises(ValueError):
        ArithmeticTask(num_steps=(3, 2))
    with pytest.raises(KeyError, match="unknown difficulty"):
        ArithmeticTask.from_difficulty("extreme")
