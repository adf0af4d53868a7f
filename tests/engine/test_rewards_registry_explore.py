"""A reward of one's own, found by an exploratory audit: registering a class instance, a
partial or a closure under a name taken, registering what is no function, and a bad reward
whose name or value holds "item N" (the trainer named another prompt and agent by it), and
a value no worker process can send back."""
import functools
import multiprocessing
import re

import pytest

from hacpo.engine import rewards
from hacpo.engine.evaluate import score_named
from hacpo.engine.rewards import RewardComputer, get_reward_fn, register_reward


class _Constant:
    """A reward as a class instance (picklable: its class is module-level)."""

    def __init__(self, value):
        self.value = value

    def __call__(self, response, gold):
        return self.value


def _constant(response, gold, value):
    return value


def _closure(value):
    def reward(response, gold):
        return value
    return reward


# module-level: the pool's spawned workers import it
@register_reward("explore_generator")
def _generator_reward(response, gold):
    return (1.0 for _ in response)        # a user's bug: no number


@pytest.fixture
def registered():
    """Names the test registers, removed after it."""
    names = []
    yield names
    for name in names:
        rewards._REGISTRY.pop(name, None)


@pytest.mark.parametrize("make", [_Constant, functools.partial(functools.partial, _constant),
                                  _closure], ids=["instance", "partial", "closure"])
def test_another_reward_of_a_taken_name_is_an_error(registered, make):
    """Two class instances (two partials, two closures of one factory) registered under one
    name: the second silently replaced the first (taken for a module re-import); a function
    registered over an instance or a partial raised AttributeError (``__qualname__``)."""
    registered.append("explore_taken")
    first = register_reward("explore_taken", in_process=True)(make(value=0.25))
    with pytest.raises(ValueError, match=r"reward 'explore_taken' is already registered \(.*\); "
                                         r"pass overwrite=True to replace it"):
        register_reward("explore_taken", in_process=True)(make(value=1.0))
    with pytest.raises(ValueError, match="reward 'explore_taken' is already registered"):
        register_reward("explore_taken", in_process=True)(_constant)
    assert get_reward_fn("explore_taken") is first
    assert register_reward("explore_taken")(first) is first        # the same object: a no-op
    second = register_reward("explore_taken", in_process=True, overwrite=True)(make(value=1.0))
    assert get_reward_fn("explore_taken") is second


def test_registering_what_is_no_function_is_a_type_error(registered):
    """A value registered as a reward: every item then scored 0 as an error ("'float' object
    is not callable") and the run went on."""
    registered.append("explore_not_callable")
    with pytest.raises(TypeError, match=r"reward 'explore_not_callable': register a callable "
                                        r"\(response, gold\) -> float, not 0\.5"):
        register_reward("explore_not_callable")(0.5)
    assert "explore_not_callable" not in rewards.list_rewards()


@pytest.mark.parametrize("name,value", [
    ("explore item 3 check", 1.5),                   # "item 3" in the reward's name
    ("explore_echo", "item 5"),                       # in the value: the response returned
])
def test_a_bad_reward_names_its_own_prompt_and_agent(registered, name, value):
    """The trainer read the bad item's index from the error's first "item N": one in the
    reward's name or value gave another sample's prompt and agent, or an IndexError."""
    registered.append(name)
    register_reward(name, in_process=True)(functools.partial(_constant, value=value))
    where = ["prompt 0, agent a", "prompt 1, agent b"]
    with RewardComputer(name) as rc:
        with pytest.raises(ValueError, match=r"for item 0: .*\(prompt 0, agent a\)$"):
            score_named(rc, ["x", "y"], ["1", "1"], where.__getitem__)


def test_an_int_beyond_float_range_is_out_of_range(registered):
    """A reward returning a huge int raised a bare OverflowError naming no reward or item."""
    registered.append("explore_huge")
    register_reward("explore_huge", in_process=True)(functools.partial(_constant,
                                                                       value=10 ** 400))
    with RewardComputer("explore_huge") as rc:
        with pytest.raises(ValueError, match=re.escape(
                "reward 'explore_huge' returned inf for item 0: rewards must be finite and in "
                "[0, 1]")):
            rc.score(["x"], ["1"])


def test_a_value_its_worker_cannot_send_back_is_an_error_as_in_process():
    """A reward returning no number (a generator) in a pool worker: its result did not
    pickle, and every item scored 0 as a reward error, the run going on; in-process the same
    reward is an error naming the item. Both are that error now."""
    want = r"reward 'explore_generator' returned {} for item 0: not a number"
    with RewardComputer("explore_generator", num_workers=0) as rc:
        with pytest.raises(ValueError, match=want.format("<generator object .*>")):
            rc.score(["x", "y"], ["1", "1"])
    with RewardComputer("explore_generator", num_workers=1, timeout_s=30,
                        hard_timeout_s=60) as rc:
        with pytest.raises(ValueError, match=want.format(re.escape(
                "a value its worker process could not send back (TypeError: cannot pickle "
                "'generator' object)"))):
            rc.score(["x", "y"], ["1", "1"])
    assert not multiprocessing.active_children()
