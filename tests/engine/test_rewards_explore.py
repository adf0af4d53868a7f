"""The ``math`` verifier on answers found by an exploratory audit: mixed numbers in running
text, decimal percents, unicode math signs, scientific notation on the slow path, a comma and
a space in a number, and gold answers that are not text."""
import re

import pytest

from hacpo.engine.rewards import (RewardComputer, extract_answer, get_reward_fn, math_reward,
                                  parse_number, register_reward)


@register_reward("test_explore_any_gold", in_process=True)
def _any_gold_reward(response: str, gold) -> float:
    return 1.0 if gold == 42 else 0.0


@pytest.mark.parametrize("response,gold,expected", [
    # a mixed number as the last number: its fraction alone was the answer ("1/2", "3/4")
    ("She needs 1 1/2 cups of flour.", "1.5", 1.0),
    ("She needs 2 3/4 cups.", "11/4", 1.0),
    ("She needs 1 1/2 cups of flour.", "0.5", 0.0),
    # a decimal percent is its number and its fraction, as a whole one is: "12.5%" was
    # neither 12.5 nor, as a gold, "7.5%" its number 7.5
    ("#### 12.5%", "12.5", 1.0),
    ("The answer is 12.5%.", "12.5", 1.0),
    (r"\boxed{12.5\%}", "0.125", 1.0),
    (r"\boxed{7.5}", r"7.5\%", 1.0),
    ("#### 0.075", "7.5%", 1.0),
    ("#### 0.08", "7.5%", 0.0),
    (r"\boxed{12.5\%}", "12.6", 0.0),
    # unicode signs math-verify does not read: "3·4" was 3 (a wrong answer scored 1), "√4",
    # "∞" no value (a right one scored 0)
    (r"\boxed{3·4}", "3", 0.0),
    (r"\boxed{3·4}", "12", 1.0),
    ("#### 3⋅4", "12", 1.0),
    (r"\boxed{2·π}", "2", 0.0),
    (r"\boxed{√4}", "2", 1.0),
    (r"\boxed{2√3}", r"\sqrt{12}", 1.0),
    (r"\boxed{√x}", r"\sqrt{x}", 1.0),
    (r"\boxed{√2}", "2", 0.0),
    (r"\boxed{(-∞, 2]}", r"(-\infty, 2]", 1.0),
    (r"\boxed{(-∞, 2]}", r"(-\infty, 2)", 0.0),
    # scientific notation beside other math (the slow path): math-verify read 1.2e3 as
    # 1.2 * e * 3 (Euler's e); as a plain number the fast path already read it right
    (r"\boxed{1.2e3}", r"1.2 \times 10^3", 1.0),
    (r"The answer is 6.02 \times 10^{23}.", "6.02e23", 1.0),
    (r"\boxed{1.5e3 \text{ m}}", "1500", 1.0),
    (r"\boxed{x = 1e3}", "x = 1000", 1.0),
    (r"\boxed{3.3e-4}", r"3.2\times10^{-4}", 0.0),
    (r"\boxed{2e}", "2e", 1.0),
    # a comma and a space part a list (two solutions), not thousands: "3, 125" was 3125
    (r"\boxed{3125}", "3, 125", 0.0),
    (r"\boxed{3, 125}", "3125", 0.0),
    (r"\boxed{125, 3}", "3, 125", 1.0),
    (r"\boxed{3,125}", "3125", 1.0),
])
def test_math_reward_explored_answers(response, gold, expected):
    assert math_reward(response, gold) == expected


def test_mixed_numbers_and_lists_are_read_whole():
    assert extract_answer("So 2 3/4 cups.") == "2 3/4"
    assert extract_answer("Step 3 5/4") == "5/4"         # improper: not a mixed number
    assert extract_answer("x = 3\n1/2") == "1/2"         # a line apart
    assert parse_number("3, 125") is None
    assert parse_number("3,125") == 3125
    assert get_reward_fn("exact")(r"\boxed{3125}", "3, 125") == 0.0


@pytest.mark.parametrize("name", ["math", "exact", "numeric_closeness"])
@pytest.mark.parametrize("gold,shown", [(42, "42 (int)"), (None, "None (NoneType)"),
                                        (" ", "' ' (str)")])
def test_a_gold_that_is_no_text_is_an_error_naming_its_item(name, gold, shown):
    # it scored 0 as a reward error ("'int' object has no attribute 'isascii'") every time
    with RewardComputer(name, num_workers=0) as rc:
        with pytest.raises(ValueError, match=re.escape(f"gold answer of item 1 is {shown}, not a")):
            rc.score(["#### 42", "#### 42"], ["42", gold])


def test_a_reward_of_ones_own_gets_any_gold():
    with RewardComputer("test_explore_any_gold", num_workers=0) as rc:
        assert rc.score(["#### 42"], [42])[0] == [1.0]
