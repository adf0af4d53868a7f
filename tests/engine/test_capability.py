"""CapabilityTracker: windows, floor, ratio clamping, state — numbers computed by hand."""
import math

import pytest
import torch

from hacpo.engine import CapabilityTracker


def _step(t, r0, r1):
    r = torch.tensor(r0 + r1, dtype=torch.float32)
    a = torch.tensor([0] * len(r0) + [1] * len(r1))
    return t.update(r, a)


def test_window_start_middle_after_k():
    t = CapabilityTracker(2, window=3)
    assert torch.equal(t.phat(), torch.ones(2, dtype=torch.float64))      # before any update
    assert torch.equal(t.ratios(), torch.ones(2, 2, dtype=torch.float64))
    # step 1: agent0 2/4 positive, agent1 1/4 -> Phat = [0.5, 0.25]
    p = _step(t, [1, 0, 0, 1], [0, 0, 0, 1])
    torch.testing.assert_close(p, torch.tensor([0.5, 0.25], dtype=torch.float64))
    torch.testing.assert_close(t.ratios(), torch.tensor([[1.0, 2.0], [0.5, 1.0]],
                                                        dtype=torch.float64))
    # step 2: agent0 4/4, agent1 0/4 -> floored at 1e-8. Phat0 = (0.5+1)/2, Phat1 = (0.25+1e-8)/2
    p = _step(t, [1, 1, 1, 1], [0, 0, 0, 0])
    torch.testing.assert_close(p, torch.tensor([0.75, 0.125000005], dtype=torch.float64),
                               rtol=1e-12, atol=0)
    # step 3 (window full): agent0 0/4 -> 1e-8, agent1 2/4
    p = _step(t, [0, 0, 0, 0], [1, 1, 0, 0])
    torch.testing.assert_close(p, torch.tensor([(1.5 + 1e-8) / 3, (0.75 + 1e-8) / 3],
                                               dtype=torch.float64), rtol=1e-12, atol=0)
    # step 4: step 1 leaves the window. agent0 1/4, agent1 3/4
    p = _step(t, [1, 0, 0, 0], [1, 1, 1, 0])
    torch.testing.assert_close(p, torch.tensor([(1 + 1e-8 + 0.25) / 3, (1e-8 + 0.5 + 0.75) / 3],
                                               dtype=torch.float64), rtol=1e-12, atol=0)
    assert t.count == 4


def test_ratio_clamping_and_reward_mean_metric():
    t = CapabilityTracker(2, window=5, metric="reward_mean")
    # reward_mean: agent0 mean 1.0, agent1 mean 0.05 -> raw ratio 20 -> clamped to 10 and 0.1
    _step(t, [1.0, 1.0], [0.1, 0.0])
    torch.testing.assert_close(t.phat(), torch.tensor([1.0, 0.05], dtype=torch.float64))
    torch.testing.assert_close(t.ratios(), torch.tensor([[1.0, 10.0], [0.1, 1.0]],
                                                        dtype=torch.float64))
    t2 = CapabilityTracker(2, ratio_min=0.5, ratio_max=4.0)
    _step(t2, [1, 1], [1, 0])   # Phat [1, 0.5] -> 2 and 0.5 (inside [0.5, 4])
    torch.testing.assert_close(t2.ratios(), torch.tensor([[1.0, 2.0], [0.5, 1.0]],
                                                         dtype=torch.float64))


def test_zero_reward_for_k_steps_is_floored_and_finite():
    t = CapabilityTracker(3, window=5)
    for _ in range(7):
        r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
        a = torch.tensor([0, 0, 1, 1, 2, 2])
        t.update(r, a)
    torch.testing.assert_close(t.phat(), torch.tensor([1.0, 0.5, 1e-8], dtype=torch.float64))
    om = t.ratios()
    assert torch.isfinite(om).all()
    assert om[0, 2] == 10.0 and om[2, 0] == 0.1 and om[1, 2] == 10.0 and om[2, 1] == 0.1


def test_state_dict_roundtrip_and_mismatch():
    t = CapabilityTracker(2, window=3)
    _step(t, [1, 0], [0, 0])
    _step(t, [1, 1], [1, 0])
    t2 = CapabilityTracker(2, window=3)
    t2.load_state_dict(t.state_dict())
    assert torch.equal(t2.phat(), t.phat()) and t2.count == 2
    _step(t, [0, 1], [1, 1]); _step(t2, [0, 1], [1, 1])
    assert torch.equal(t2.ratios(), t.ratios())
    with pytest.raises(ValueError, match="window"):
        CapabilityTracker(2, window=4).load_state_dict(t.state_dict())
    # a hand-edited or corrupted state: named, never a tracker of another window or width
    good = t.state_dict()
    for bad, match in (({"history": torch.ones(2, 2)}, r"shape \(2, 2\), not \[num_agents, "
                                                       r"window\] = \[2, 3\]"),
                       ({"history": torch.ones(1, 3)}, r"shape \(1, 3\)"),
                       ({"history": [[1, 1, "x"], [1, 1, 1]]}, "no \\[2, 3\\] table"),
                       ({"history": torch.full((2, 3), math.nan)}, "not finite and > 0"),
                       ({"count": -3}, "count must be a whole number >= 0, got -3"),
                       ({"count": 1.5}, "got 1.5")):
        t3 = CapabilityTracker(2, window=3)
        with pytest.raises(ValueError, match=match):
            t3.load_state_dict({**good, **bad})
        assert t3.count == 0 and torch.equal(t3.history, torch.ones(2, 3, dtype=torch.float64))
    t4 = CapabilityTracker(2, window=3)      # a history as a list (a state read from JSON)
    t4.load_state_dict({**good, "history": good["history"].tolist()})
    assert torch.equal(t4.ratios(), t.ratios())


@pytest.mark.parametrize("rewards,match", [([0.5, 1.5], r"sample 1 \(agent 1\) is 1.5"),
                                           ([float("nan"), 0.0], "sample 0"),
                                           ([-0.1, 0.0], "sample 0")])
def test_bad_rewards_name_the_sample(rewards, match):
    t = CapabilityTracker(2)
    with pytest.raises(ValueError, match=match):
        t.update(torch.tensor(rewards), torch.tensor([0, 1]))


def test_bad_agents_and_config():
    t = CapabilityTracker(2)
    with pytest.raises(ValueError, match="agent index 2 of sample 1"):
        t.update(torch.tensor([0.0, 1.0]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"no samples for agent\(s\) \[1\]"):
        t.update(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="shape mismatch"):
        t.update(torch.tensor([0.0, 1.0]), torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match="window"):
        CapabilityTracker(2, window=0)
    with pytest.raises(ValueError, match="ratio_min"):
        CapabilityTracker(2, ratio_min=5.0, ratio_max=2.0)
    with pytest.raises(ValueError, match="ratio_min"):       # an infinite floor: NaN ratios
        CapabilityTracker(2, ratio_min=math.inf, ratio_max=math.inf)
    for lo, hi in ((2.0, 5.0), (0.1, 0.5)):     # no 1: an agent's ratio to itself clamped
        with pytest.raises(ValueError, match="ratio_min <= 1 <= ratio_max"):
            CapabilityTracker(2, ratio_min=lo, ratio_max=hi)
    for minimum in (1.0, 5.0, math.inf, 0.0, math.nan):     # >= 1: every ratio 1
        with pytest.raises(ValueError, match=r"capability minimum must be in \(0, 1\)"):
            CapabilityTracker(2, minimum=minimum)
    # a float or bool size is an error naming it (was torch.ones' TypeError / window=True as 1)
    for kwargs, name in (({"window": 2.5}, "window"), ({"window": True}, "window"),
                         ({"num_agents": 2.0}, "num_agents")):
        with pytest.raises(ValueError, match=f"{name} must be a whole number >= 1"):
            CapabilityTracker(**{"num_agents": 2, **kwargs})
    with pytest.raises(ValueError, match="metric"):
        CapabilityTracker(2, metric="accuracy")
