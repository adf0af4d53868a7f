"""Rewards: answer extraction, the math verifier, the registry and the batch scorer.

Pool tests share one 1-worker pool (module fixture) to keep process start-up cost small.
"""
import math
import multiprocessing
import os
import signal
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest

from hacpo.engine.rewards import (RewardComputer, extract_answer, get_reward_fn,
                                  list_rewards, math_fast_path, math_reward, parse_number,
                                  register_reward)


# Test rewards: module-level so spawned pool workers can import them by reference.
@register_reward("test_sleep")
def _sleep_reward(response: str, gold: str) -> float:
    if response == "slow":
        time.sleep(30)  # interrupted by the worker's SIGALRM timer
    return 1.0


@register_reward("test_hang")
def _hang_reward(response: str, gold: str) -> float:
    if response == "hang":
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # deaf to the soft timeout
        time.sleep(30)
    return 1.0


@register_reward("test_raise")
def _raise_reward(response: str, gold: str) -> float:
    if response == "boom":
        raise RuntimeError("boom")
    if response == "exit":
        sys.exit(3)
    if response == "sigterm":       # as the trainer's SIGTERM handler does, landing here
        from hacpo.launch.cli import _raise_terminated
        before = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            signal.signal(signal.SIGTERM, before)
    return 0.5


@register_reward("test_pause")
def _pause_reward(response: str, gold: str) -> float:
    time.sleep(0.2)
    return 1.0


@register_reward("test_crash")
def _crash_reward(response: str, gold: str) -> float:
    """``gold``: a folder. "crash" and "a" wait for each other (both run at once, one per
    worker), then "crash" kills its worker process (as a segfaulting C extension would)."""
    (Path(gold) / f"{response}.started").touch()
    other = Path(gold) / ("a.started" if response == "crash" else "crash.started")
    deadline = time.monotonic() + 30
    while not other.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    if response == "crash":
        os._exit(3)
    time.sleep(0.5)          # still running when its pool breaks
    return 1.0


@register_reward("test_range", in_process=True)
def _range_reward(response: str, gold: str) -> float:
    return float(response)


def test_builtins_registered():
    assert {"math", "exact", "numeric_closeness"} <= set(list_rewards())
    assert get_reward_fn("math") is math_reward
    with pytest.raises(KeyError, match="unknown reward 'nope'") as e:
        get_reward_fn("nope")
    # (a run of a reward registered by the user's code, evaluated by `hacpo eval`)
    assert "the hacpo command imports none, so train / evaluate such a run through the " \
           "Python API" in str(e.value)
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math")(lambda r, g: 0.0)


@pytest.mark.parametrize("response,gold,expected", [
    (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.25", 0.0),
    (r"we get \boxed{\frac{\sqrt{2}}{2}}", r"\sqrt{2}/2", 1.0),   # slow path (math-verify)
    (r"\boxed{x^{2}+1}", "1+x^2", 1.0),
    (r"\boxed{\{1,2\}} is the set", r"\boxed{\{1, 2\}}", 1.0),     # nested braces, boxed gold
    ("Adding up: 600 + 400.\n#### 1,000", "1000", 1.0),
    ("#### 1,000", "#### 1000", 1.0),
    ("The temperature drops to -7.", "-7", 1.0),
    ("The temperature drops to -7.", "7", 0.0),
    ("10 - 3 = 7", "-3", 0.0),                 # subtraction is not a sign: last number is 7
    ("The answer is 42.", "42", 1.0),
    ("I think 3, then 17, so finally 42", "42", 1.0),
    ("I think 42, no wait, 17", "42", 0.0),    # last number wins
    ("I have no idea.", "42", 0.0),
    ("", "0", 0.0),
    ("The answer is $\\frac{3}{4}$.", "0.75", 1.0),
    ("It is 2.50 dollars", "2.5", 1.0),
    ("so 3/4 of them", r"\frac{3}{4}", 1.0),
    # Markdown emphasis around the answer.
    ("The final answer is **42**.", "42", 1.0),
    ("#### **42**", "42", 1.0),
    # Units after "####" (OpenAI's and lm-eval's GSM8K graders read the number after it).
    ("#### 5 dollars", "5", 1.0),
    ("#### $18.00 per day", "18", 1.0),
    # After "answer is", the number right after it, unless an operator follows it.
    ("The answer is 120 minutes, or 2 hours.", "120", 1.0),
    ("The answer is 18 dollars per day for 7 days.", "18", 1.0),
    ("The answer is 10 - 2, which is 8.", "8", 1.0),
    ("So the answer is that she has 3 times as many, so 15.", "15", 1.0),
    ("The answer is 1/2 cup.", "0.5", 1.0),
    ("The answer is 42 (the number of apples).", "42", 1.0),
    ("The answer is 5 + 3", "8", 1.0),                      # math: left to math-verify
    # A minus before the dollar sign.
    ("The answer is -$5.", "-5", 1.0),
    ("#### -$5", "-5", 1.0),
    # Mixed numbers; digits apart are not one number.
    ("#### 2 3/4", "2.75", 1.0),
    ("#### 2 3/4", "5.75", 0.0),
    ("#### 2 3/4 cups", "2.75", 1.0),
    ("The answer is 3 4", "34", 0.0),
    # LaTeX inline / display math delimiters around the answer (Qwen- and DeepSeek-style
    # outputs): "\(1{,}000\)" was read as the tuple (1, 000) and scored 0
    (r"The answer is \(1{,}000\).", "1000", 1.0),
    (r"#### \(1,000\)", "1000", 1.0),
    (r"The answer is \[12{,}345\]", "12345", 1.0),
    (r"The answer is \(\frac{3}{4}\).", "0.75", 1.0),
    (r"The answer is \(1{,}000\).", "100", 0.0),
    # thousands apart by a no-break, narrow no-break or thin space, as typeset
    ("#### 1\u00a0000", "1000", 1.0),
    ("The answer is 12\u202f345.", "12345", 1.0),
    ("#### 1\u2009000", "1000", 1.0),
    ("#### 1\u00a0000", "1", 0.0),
    # a gold with units (a user's {"answer": "18 dollars"}) is its number, as the response's
    # answer after "####" is: the warm-up's own target "#### 18 dollars" scored 0
    ("#### 18 dollars", "18 dollars", 1.0),
    ("The answer is 12.", "12 eggs", 1.0),
    ("#### 2 3/4 cups", "2 3/4 cups", 1.0),
    ("#### 1,000 people", "1,000 people", 1.0),
    ("#### 17", "18 dollars", 0.0),
    ("#### 3", "3 and 4", 0.0),                 # digits after the words: not a unit
    ("#### 2", "2 pi", 0.0),                    # a constant, not a unit
    # an expression in a variable after "####" is the answer, not a heading followed by a
    # last number: "#### -x+1" was read as 1
    ("#### -x+1", "1", 0.0),
    ("#### -x+1", "1-x", 1.0),
    ("#### x^2+1", "x^2+1", 1.0),
])
def test_math_reward(response, gold, expected):
    assert math_reward(response, gold) == expected


# Unicode fractions, powers, invisible characters and minus signs, on either side: a "½" or "²"
# after a number was dropped ("2½" scored as 2, "5²" as 5) and a bidi mark or a fullwidth
# minus made a right answer score 0.
@pytest.mark.parametrize("response,gold,expected", [
    ("#### 2½", "2", 0.0),
    ("The answer is 2½ cups.", "2", 0.0),
    ("#### 3¼", "3", 0.0),
    ("#### 5 ⅓", "5", 0.0),
    ("#### 5²", "5", 0.0),
    ("#### 5²", "25", 1.0),                   # a power, not the number 5
    ("#### 12.5", "12½", 1.0),
    ("#### 1/2", "½", 1.0),
    ("#### -2½", "-2.5", 1.0),
    ("#### \u22122½", "-5/2", 1.0),
    ("#### 2 ½", "2.5", 1.0),
    ("#### 2¹⁄₂", "2.5", 1.0),                 # superscript / subscript digits, fraction slash
    ("#### 1⁄2", "0.5", 1.0),
    (r"\boxed{2½}", "5/2", 1.0),
    ("#### 5①", "5", 0.0),                    # another non-decimal digit: not the number 5
    ("The answer is 5① apples.", "5", 0.0),
    ("#### 5₂", "5", 0.0),
    ("#### 25 cm²", "25", 1.0),               # after a unit, a superscript is the unit's
    ("#### \u200f5", "5", 1.0),
    ("#### -5", "\u200f-5", 1.0),
    ("#### \uff0d5", "-5", 1.0),
    ("#### \ufe635", "-5", 1.0),
    ("#### 7", "\ufeff7", 1.0),
    ("#### 1\u00ad000", "1000", 1.0),
    ("#### \u202a12\u202c", "12", 1.0),
    ("#### 2\u20623", "6", 1.0),              # invisible times: 2*3, not 23
    # a mixed number is one improper fraction: math-verify read "2 1/2" as 2 * 1/2 = 3/2 and
    # the last-number rule took its "1/2"
    (r"\boxed{x = 3/2}", "x = 2½", 0.0),
    (r"\boxed{x = 5/2}", "x = 2½", 1.0),
    (r"\boxed{3.5}", "5-2½", 0.0),
    (r"\boxed{2.5}", "5-2½", 1.0),
    (r"\boxed{1, 1.5}", "1½, 2½", 0.0),
    (r"\boxed{(2.5, 3.5)}", "(2½, 3½)", 1.0),
    (r"\boxed{x = 2½}", "x = 1.5", 0.0),
    (r"\boxed{\frac{1}{2x}}", "½x", 0.0),
    (r"\boxed{\frac{x}{2}}", "½x", 1.0),
    (r"\boxed{1½}", r"\frac32", 1.0),
    ("So she needs 2½ cups.", "2.5", 1.0),
    # as before
    ("#### 1 000", "1000", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("#### \u22125", "-5", 1.0),
    ("#### \u22125", "5", 0.0),
    ("#### \uff15", "5", 1.0),
    ("#### 5\u200b", "5", 1.0),
])
def test_math_reward_unicode_numbers(response, gold, expected):
    assert math_reward(response, gold) == expected


def test_unicode_fractions_parse_as_numbers():
    assert parse_number("2½") == Fraction(5, 2)
    assert parse_number("-2½") == Fraction(-5, 2)
    assert parse_number("½") == Fraction(1, 2)
    assert parse_number("⅞") == Fraction(7, 8)
    assert parse_number("5²") is None         # a power: math-verify's to evaluate
    assert parse_number("5①") is None
    assert extract_answer("The total is 5² = 25 m².") == "25"


def test_math_delimiters_are_stripped_only_around_one_expression():
    assert extract_answer(r"The answer is \(x = 5\).") == "5"
    assert extract_answer(r"#### \(2\) and \(3\)") == r"\(2\) and \(3\)"   # two, kept


def test_fast_path_decides_plain_numbers_without_math_verify():
    assert math_fast_path("#### 1,000", "1000") == 1.0
    assert math_fast_path("x = -2.5", "-5/2") == 1.0
    assert math_fast_path("no number", "3") == 0.0
    assert math_fast_path(r"\boxed{\sqrt{2}}", "1.41") is None  # needs math-verify
    # Exact comparison: a rounded decimal is not a fraction.
    assert math_fast_path("0.333", "1/3") == 0.0


def test_extraction_and_number_parsing():
    assert extract_answer(r"x \boxed{a^{b^{c}}} y") == "a^{b^{c}}"
    assert extract_answer(r"\boxed{1} then \boxed{2}.") == "2"
    assert extract_answer("the answer is: 7 - 2 = 5.") == "5"
    assert parse_number("1,234.5") == parse_number("2469/2")
    assert parse_number(r"-\frac{1}{2}") == parse_number("-0.5")
    assert parse_number("12 apples") is None


def test_markdown_headings_are_not_gsm8k_answers():
    steps = ("#### Step 1: Add the costs\n5 + 3 = 8\n#### Step 2: Double it\n8 * 2 = 16\n"
             "The answer is 16.")
    assert extract_answer(steps) == "16" and math_reward(steps, "16") == 1.0
    final = "#### Solution\nShe buys 3 packs of 4, so 12 eggs.\n#### Final Answer\n12"
    assert math_reward(final, "12") == 1.0
    assert extract_answer("#### 42\n#### Explanation\nI added 40 and 2.") == "42"
    # Values after "####" still count.
    assert extract_answer(r"#### \frac{1}{2}") == r"\frac{1}{2}"
    assert extract_answer("#### x = 3") == "x = 3"
    assert extract_answer("#### (B)") == "(B)"
    assert extract_answer("#### -7") == "-7"
    # a heading's word with a hyphen is not an expression ("x-intercept": a letter follows)
    assert extract_answer("#### x-intercepts\nThey are at 4.") == "4"


def test_number_parsing_spaces_and_mixed_numbers():
    assert parse_number("2 3/4") == Fraction(11, 4)
    assert parse_number("-2 1/2") == Fraction(-5, 2)
    assert parse_number("1 000 000") == 1000000
    assert parse_number(r"10,\!000") == 10000
    assert parse_number("- 5") == -5
    assert parse_number("3 4") is None        # was 34
    assert parse_number("2 5/4") is None      # not a mixed number: left to math-verify


def test_long_degenerate_outputs_are_fast():
    # The fast path runs in the caller's process without a timeout. Thousands of unbalanced
    # "\boxed{" (a degenerate generation) cost quadratic time: ~4 s at 4,000, ~70 s at 16,000.
    text = r"\boxed{3} " + r"\boxed{" * 6000
    t0 = time.perf_counter()
    assert extract_answer(text) == "3"
    assert math_fast_path(text, "3") == 1.0
    assert math_fast_path(r"\boxed{" * 6000, "1") == 0.0
    assert math_fast_path(r"\boxed\frac{1}{" * 10000, "2") == 0.0    # "\boxed" without a brace
    assert time.perf_counter() - t0 < 1.0


def test_huge_numbers_score_zero_without_error():
    digits = "1" * 5000                       # over Python's int-from-str limit (4300 digits)
    assert parse_number(digits) is None
    assert math_fast_path(digits, "1") is None  # left to math-verify, under the timeout
    assert math_reward("#### " + digits, "1") == 0.0
    close = get_reward_fn("numeric_closeness")
    assert close("#### 1" + "0" * 400, "10") == 0.0   # a distance beyond float range
    assert close("#### 1" + "0" * 400, "1" + "0" * 400) == 1.0
    with RewardComputer("math", num_workers=0, timeout_s=5) as rc:
        rewards, stats = rc.score([digits, "#### " + digits], ["1", "1"])
    assert rewards == [0.0, 0.0] and stats.errors == stats.timeouts == 0


def test_exact_and_numeric_closeness():
    exact, close = get_reward_fn("exact"), get_reward_fn("numeric_closeness")
    assert exact("The answer is  Paris.", "paris") == 1.0
    assert exact("#### 1,000", "1000") == 1.0
    assert exact("#### 999", "1000") == 0.0
    assert close("#### 10", "10") == 1.0
    assert close("#### 11", "10") == pytest.approx(math.exp(-0.1))
    assert close("#### 100", "10") == pytest.approx(math.exp(-9))      # scale |gold|
    assert close("#### 0.5", "0") == pytest.approx(math.exp(-0.5))      # scale at least 1
    assert close("#### 1000000", "10") == 0.0      # exp(-99999) underflows to 0
    assert close("no number", "10") == 0.0


def test_in_process_scoring_counts_fast_and_slow():
    responses = ["#### 5", r"\boxed{\frac{\sqrt{2}}{2}}", "nothing", "#### 4"]
    golds = ["5", r"\sqrt{2}/2", "1", "5"]
    with RewardComputer("math", num_workers=0, timeout_s=5) as rc:
        rewards, stats = rc.score(responses, golds)
    assert rewards == [1.0, 1.0, 0.0, 0.0]
    assert (stats.total, stats.fast_path, stats.slow_path) == (4, 3, 1)
    assert stats.errors == stats.timeouts == 0
    assert stats.seconds > 0        # the call's wall time (metrics reward_fn/seconds)


def test_in_process_timeout_and_error_score_zero():
    t0 = time.monotonic()
    with RewardComputer("test_sleep", num_workers=0, timeout_s=0.2) as rc:
        rewards, stats = rc.score(["fast", "slow", "fast"], ["", "", ""])
    assert time.monotonic() - t0 < 5
    assert rewards == [1.0, 0.0, 1.0]
    assert stats.timeouts == 1 and stats.errors == 0
    assert stats.failures[0][0] == 1
    with RewardComputer("test_raise", num_workers=0) as rc:
        rewards, stats = rc.score(["ok", "boom"], ["", ""])
    assert rewards == [0.5, 0.0] and stats.errors == 1
    assert "RuntimeError: boom" in stats.failures[0][1]
    # a SystemExit stops the caller (hacpo's SIGTERM handler raises one wherever the main
    # thread is: scored as a failing reward, the stop was lost)
    with RewardComputer("test_raise", num_workers=0) as rc:
        with pytest.raises(SystemExit) as e:
            rc.score(["ok", "sigterm"], ["", ""])
    assert e.value.code == 143


@pytest.fixture
def caller_timer():
    """The caller's own SIGALRM handler (counting its calls), its timer disarmed after."""
    fired = []

    def handler(*_):
        fired.append(handler)
    old = signal.signal(signal.SIGALRM, handler)
    yield fired
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def test_in_process_reward_keeps_the_callers_timer(caller_timer):
    """A caller's alarm (a notebook's or sweep's watchdog) armed before an in-process slow-path
    reward: it was disarmed for good by the reward's own timeout timer. It is put back with
    what is left of it, and its handler too; one that fell due during the reward fires as it
    returns (not lost)."""
    signal.setitimer(signal.ITIMER_REAL, 100.0)
    with RewardComputer("test_sleep", num_workers=0, timeout_s=5) as rc:
        assert rc.score(["fast"], [""])[0] == [1.0]
    left = signal.getitimer(signal.ITIMER_REAL)[0]
    assert 0 < left <= 100.0 and not caller_timer
    handler = signal.getsignal(signal.SIGALRM)
    assert handler.__name__ == "handler" and handler.__module__ == __name__    # the caller's
    signal.setitimer(signal.ITIMER_REAL, 0.05)      # due while the reward runs: 0.2 s
    with RewardComputer("test_pause", num_workers=0, timeout_s=5) as rc:
        rewards, stats = rc.score(["x"], [""])
    assert rewards == [1.0]                         # the reward was not cut short by it
    assert stats.seconds >= 0.2                     # its sleep is in the call's wall time
    deadline = time.monotonic() + 10
    while not caller_timer and time.monotonic() < deadline:
        time.sleep(0.01)
    assert caller_timer == [handler]


@pytest.mark.parametrize("bad", ["1.5", "-0.1", "nan", "inf"])
def test_out_of_range_reward_names_index(bad):
    with RewardComputer("test_range", num_workers=0) as rc:
        with pytest.raises(ValueError, match="item 2"):
            rc.score(["0", "1", bad], ["", "", ""])


def test_unpicklable_reward_rejected_for_pool():
    register_reward("test_lambda", overwrite=True)(lambda r, g: 1.0)
    with pytest.raises(TypeError, match="process pool"):
        RewardComputer("test_lambda", num_workers=1)


# ---- process pool (one worker, spawned once for the module) -----------------------------


def test_pool_math_timeouts_errors_and_hang():
    """One pool through every path: math slow path, soft timeout, raising fn, hung worker."""
    # math-verify's first calls (sympy) may take seconds on a loaded machine: generous limits
    # for them, short ones for the test rewards below
    rc = RewardComputer("math", num_workers=1, timeout_s=30, hard_timeout_s=60)
    try:
        rewards, stats = rc.score([r"\boxed{\frac{\sqrt{2}}{2}}", "#### 3", r"\boxed{x+1}"],
                                  [r"\sqrt{2}/2", "3", "x+2"])
        assert rewards == [1.0, 1.0, 0.0]
        assert stats.slow_path == 2 and stats.errors == stats.timeouts == 0
        pool = rc._pool
        rc.timeout_s, rc.hard_timeout_s = 0.5, 1.5
        # Reuse the same warm pool for test rewards (swap the spec: avoids a second spawn).
        from hacpo.engine.rewards import get_reward_spec
        rc.spec = get_reward_spec("test_sleep")
        t0 = time.monotonic()
        rewards, stats = rc.score(["a", "slow", "b"], ["", "", ""])
        assert rewards == [1.0, 0.0, 1.0] and stats.timeouts == 1
        assert stats.pool_restarts == 0 and rc._pool is pool  # soft timeout: worker survives
        assert time.monotonic() - t0 < 5
        rc.spec = get_reward_spec("test_raise")
        rewards, stats = rc.score(["boom", "x", "exit"], ["", "", ""])
        assert rewards == [0.0, 0.5, 0.0] and stats.errors == 2
        assert "SystemExit: 3" in stats.failures[1][1] and stats.pool_restarts == 0
        rc.spec = get_reward_spec("test_hang")
        old_procs = list(pool._processes.values())
        t0 = time.monotonic()
        rewards, stats = rc.score(["a", "hang", "b"], ["", "", ""])
        assert rewards == [1.0, 0.0, 1.0]
        assert stats.timeouts == 1 and stats.pool_restarts == 1
        assert time.monotonic() - t0 < 20
        assert not any(p.is_alive() for p in old_procs)  # the hung worker was killed
    finally:
        procs = list((rc._pool._processes or {}).values()) if rc._pool else []
        rc.close()
    assert rc._pool is None
    assert not any(p.is_alive() for p in procs)
    assert not multiprocessing.active_children()


def test_a_worker_that_dies_scores_only_its_own_item_zero(tmp_path):
    """A reward that kills its worker process broke the pool: every item in flight with it
    (running on the other worker) scored 0 with BrokenProcessPool. Those are re-run alone now,
    and only the one that kills its worker alone scores 0 (an error naming the dead worker)."""
    with RewardComputer("test_crash", num_workers=2, timeout_s=30, hard_timeout_s=60) as rc:
        rewards, stats = rc.score(["a", "crash", "b", "c"], [str(tmp_path)] * 4)
        assert rewards == [1.0, 0.0, 1.0, 1.0]
        assert stats.errors == 1 and stats.timeouts == 0 and stats.pool_restarts == 2
        (index, message), = stats.failures
        assert index == 1 and "the reward's worker process died scoring it" in message
        assert rc.score(["d", "e"], [str(tmp_path)] * 2)[0] == [1.0, 1.0]   # the pool works on
    assert not multiprocessing.active_children()


# A child script: a 2-worker pool started with a signal sent at the worst moment, right after
# a worker process is spawned and before the pool has sent it its start-up message.
_SIGNALLED_START = r'''
import multiprocessing, multiprocessing.util as util, os, signal, sys, time
from hacpo.engine.rewards import RewardComputer
target = sys.argv[1]
spawn = util.spawnv_passfds
def spawn_then_signal(path, args, fds):
    pid = spawn(path, args, fds)
    # the first worker (not the resource tracker, also spawned here)
    if "--multiprocessing-fork" in args and not getattr(spawn_then_signal, "done", False):
        spawn_then_signal.done = True
        os.kill(os.getpid() if target == "parent" else pid, signal.SIGINT)
        time.sleep(0.5)         # the parent runs its SIGINT handler here, before pid is returned
    return pid
util.spawnv_passfds = spawn_then_signal
rc = RewardComputer("math", num_workers=2)
args = ([r"\boxed{x+1}", r"\boxed{\frac{\sqrt{2}}{2}}"], ["x+2", r"\sqrt{2}/2"])
try:
    print("rewards", rc.score(*args)[0], flush=True)
except KeyboardInterrupt:
    def alive_workers():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                state_ppid = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[:2]
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if state_ppid[0] != "Z" and int(state_ppid[1]) == os.getpid() \
                    and b"--multiprocessing-fork" in cmdline:
                found.append(pid)
        return found
    print("interrupted; workers left:", alive_workers(), rc._pool, flush=True)
    sys.exit(0)
# a terminal's Ctrl-C reaches the running workers too: they ignore it, the pool stays usable
for p in rc._pool._processes.values():
    os.kill(p.pid, signal.SIGINT)
print("rewards", rc.score(*args)[0], flush=True)
rc.close()
'''


@pytest.mark.parametrize("target", ["parent", "worker"])
def test_ctrl_c_while_the_pool_starts_leaves_no_traceback(target):
    """Ctrl-C while reward workers are being spawned: the parent's KeyboardInterrupt waits
    until the spawn is done (a child fed half a start-up message printed an EOFError traceback)
    and the half-started pool is killed; a Ctrl-C reaching a worker while it starts, or once it
    runs (a terminal signals the whole process group), is ignored by it, with no traceback."""
    import subprocess
    import sys
    # SIGINT's default restored: a job started in the background (CI) inherits it ignored,
    # and Python then keeps ignoring it (the parent case then never sees its Ctrl-C)
    done = subprocess.run([sys.executable, "-c", _SIGNALLED_START, target],
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    if target == "parent":
        assert done.stdout == "interrupted; workers left: [] None\n", done.stdout
    else:
        assert done.stdout == "rewards [0.0, 1.0]\n" * 2, done.stdout


@pytest.mark.parametrize("text,answer", [
    ("#### 3 was wrong; #### 5", "5"),       # two markers on one line: the last one's answer
    ("so #### 4 ####", "4"),                 # an empty last marker is passed over
    ("#### 3\nno, redo:\n#### 5", "5"),
])
def test_the_last_gsm8k_marker_on_a_line_gives_the_answer(text, answer):
    from hacpo.engine.rewards import extract_answer, gold_answer
    assert extract_answer(text) == answer
    assert gold_answer(text) == answer


_KILLED_PARENT = r'''
import os, signal, sys
from hacpo.engine.rewards import RewardComputer
rc = RewardComputer("math", num_workers=1)
rc.score([r"\boxed{x+1}"], ["x+1"])
with open(sys.argv[1], "w") as f:
    f.write(" ".join(str(p.pid) for p in rc._pool._processes.values()))
os.kill(os.getpid(), signal.SIGKILL)      # no close(): as kill -9, an OOM kill, a kernel restart
'''


def test_reward_workers_end_when_their_parent_is_killed(tmp_path):
    """A trainer (or notebook kernel) killed without stopping its pool left its reward workers
    running under init; each now ends itself within about a second of its parent's death."""
    import os
    import subprocess
    import sys
    # no pipes: a worker left running would hold them open
    rc = subprocess.run([sys.executable, "-c", _KILLED_PARENT, str(tmp_path / "pids")],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        timeout=120).returncode
    assert rc == -signal.SIGKILL
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert pids

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    deadline = time.monotonic() + 20
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    for p in left:                     # (without the fix: do not leave them running)
        os.kill(p, signal.SIGKILL)
    assert not left


def test_a_bare_register_reward_decorator_is_a_type_error():
    """@register_reward without its name registered nothing and replaced the function by the
    decorator; the user then saw "unknown reward.name"."""
    from hacpo.engine.rewards import register_reward

    with pytest.raises(TypeError, match=r'register_reward takes the reward\'s name first: use '
                                        r'@register_reward\("name"\)'):
        @register_reward
        def mine(response, gold):
            return 1.0


_MAIN_REWARD = r'''
import sys
from hacpo.engine.rewards import register_reward
from hacpo.engine.run_config import load_config
from hacpo.engine.trainer import train

@register_reward("nb_reward")
def nb_reward(response, gold):
    return 1.0

cfg = load_config("tiny3", overrides={"out_dir": sys.argv[1], "cache_dir": sys.argv[2],
                                      "reward.name": "nb_reward", "reward.num_workers": 1,
                                      "steps": 0, "threads": 1})
try:
    train(cfg, echo=lambda line: print(line, flush=True))
except ValueError as e:
    print("ERROR", e, flush=True)
'''


def test_a_reward_its_workers_cannot_load_is_an_error_before_the_warm_up(tmp_path):
    """A reward defined in __main__ (python -c, a notebook) with reward.num_workers > 0: every
    item broke the pool and scored 0, one pool restart each, and the run exited 0. The pool's
    start now loads the reward in its workers: one error, before any work."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _MAIN_REWARD, str(tmp_path / "run"),
                          str(tmp_path / "cache")], capture_output=True, text=True,
                         timeout=300)
    lines = out.stdout.splitlines()
    err = next(ln for ln in lines if ln.startswith("ERROR"))
    assert "reward 'nb_reward' (__main__.nb_reward) cannot be loaded in a reward worker " \
           "process (AttributeError: Can't get attribute 'nb_reward'" in err, out.stdout
    assert "define it in an importable module, or set reward.num_workers=0" in err
    assert not any("[warm-up]" in ln for ln in lines), lines
    assert not (tmp_path / "run").exists()


def test_a_script_rewards_unguarded_train_call_is_named(tmp_path):
    """The same reward in a script run as `python my_run.py` (its workers can import it)
    whose train() call is not under `if __name__ == "__main__":`: each spawned worker imports
    the script again and its train() ran there too (refused: the run dir is locked), so the pool
    did not start, with "BrokenProcessPool" as the only explanation. The error now says why."""
    import subprocess
    import sys
    script = tmp_path / "my_run.py"
    # (its train() fails in a worker as it would unguarded and uncaught: the lock is held)
    script.write_text(_MAIN_REWARD.replace(
        "except ValueError as e:\n", "except (ValueError, RuntimeError) as e:\n"
        "    if __name__ != \"__main__\":\n        raise\n"))
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "run"),
                          str(tmp_path / "cache")], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    err = next((ln for ln in out.stdout.splitlines() if ln.startswith("ERROR")), out.stderr)
    assert "reward worker pool (spawn) did not start: a worker failed" in err, err
    assert "reward 'nb_reward' is defined in the script run as __main__, which each worker " \
           "process imports again: put the script's train() / evaluation call under " \
           "`if __name__ == \"__main__\":`" in err, err
    # what the hint asks for: the same script with its call guarded runs
    import textwrap
    head, call = _MAIN_REWARD.split("\ncfg = load_config")
    script.write_text(head + '\nif __name__ == "__main__":\n'
                      + textwrap.indent("cfg = load_config" + call, "    "))
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "run2"),
                          str(tmp_path / "cache")], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0 and "ERROR" not in out.stdout, out.stdout + out.stderr
    assert (tmp_path / "run2" / "summary.json").exists()
