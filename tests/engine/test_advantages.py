"""Advantages: hand-computed cases, guards, n = 3 / 4 agents, edge cases."""
import math

import pytest
import torch

from hacpo.engine import group_advantages, hacpo_advantages

SIG = 0.5 + 1e-6          # unbiased std of [1, 0, 1, 1] is 0.5, plus eps
OMEGA2 = torch.tensor([[1.0, 2.0], [0.5, 1.0]], dtype=torch.float64)  # Phat0 = 2 * Phat1


def _group4():
    # one group: agent0 rewards [1, 0], agent1 rewards [1, 1]
    return (torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64), torch.zeros(4, dtype=torch.long),
            torch.tensor([0, 0, 1, 1]))


def test_learner0_binary_guard_uses_own_mean():
    r, p, a = _group4()
    # w = [1, 1, 2, 2] -> mu = (1 + 0 + 2 + 2) / 4 = 1.25 > 1 -> own mean 0.5
    A = hacpo_advantages(r, p, a, learner=0, ratios=OMEGA2)
    torch.testing.assert_close(A, torch.tensor([0.5, -0.5, 0.5, 0.5], dtype=torch.float64) / SIG)
    A = hacpo_advantages(r, p, a, learner=0, ratios=OMEGA2, binary_guard=False)
    torch.testing.assert_close(A, torch.tensor([-0.25, -1.25, -0.25, -0.25],
                                               dtype=torch.float64) / SIG)


def test_learner1_cross_samples_use_learner_baseline():
    r, p, a = _group4()
    # learner 1: w = 1/omega[s, 1] = [0.5, 0.5, 1, 1] -> mu = (0.5 + 0 + 1 + 1) / 4 = 0.625
    A = hacpo_advantages(r, p, a, learner=1, ratios=OMEGA2)
    torch.testing.assert_close(A, torch.tensor([0.375, -0.625, 0.375, 0.375],
                                               dtype=torch.float64) / SIG)


def test_source_baseline_option():
    r, p, a = _group4()
    # learner 0, cross (agent1) samples use agent1's baseline 0.625; self ones use 0.5
    A = hacpo_advantages(r, p, a, learner=0, ratios=OMEGA2, cross_baseline="source")
    torch.testing.assert_close(A, torch.tensor([0.5, -0.5, 0.375, 0.375],
                                               dtype=torch.float64) / SIG)


def test_uniform_guard_on_continuous_rewards():
    r = torch.full((4,), 0.5, dtype=torch.float64)
    p, a = torch.zeros(4, dtype=torch.long), torch.tensor([0, 0, 1, 1])
    assert torch.equal(hacpo_advantages(r, p, a, learner=0, ratios=OMEGA2),
                       torch.zeros(4, dtype=torch.float64))
    # without the guard: mu = (0.5 + 0.5 + 1 + 1) / 4 = 0.75, sigma = 0 + 1e-6
    A = hacpo_advantages(r, p, a, learner=0, ratios=OMEGA2, uniform_guard=False)
    torch.testing.assert_close(A, torch.full((4,), -0.25e6, dtype=torch.float64))


def test_three_agents_by_hand():
    # Phat = [0.5, 0.25, 1.0]; omega[s, t] = Phat_s / Phat_t; learner 0 weights w = [1, 2, 0.5]
    phat = torch.tensor([0.5, 0.25, 1.0], dtype=torch.float64)
    om = phat[:, None] / phat[None, :]
    r = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    a = torch.tensor([0, 1, 2, 2])
    A = hacpo_advantages(r, torch.zeros(4, dtype=torch.long), a, learner=0, ratios=om)
    # mu = (1 + 0 + 0.5 + 0) / 4 = 0.375; std = sqrt(1/3)
    sig = math.sqrt(1 / 3) + 1e-6
    torch.testing.assert_close(A, torch.tensor([0.625, -0.375, 0.625, -0.375],
                                               dtype=torch.float64) / sig)


def _loop_reference(r, p, a, learner, om, eps=1e-6):
    """Straight per-group Python loop of SPEC's text (for n=4 random pools)."""
    out = [0.0] * len(r)
    for g in set(p):
        idx = [i for i in range(len(r)) if p[i] == g]
        rs = [r[i] for i in idx]
        mean = sum(rs) / len(rs)
        mu = sum(r[i] / om[a[i]][learner] for i in idx) / len(idx)
        if max(rs) == min(rs):
            mu = mean
        if mu > 1:
            own = [r[i] for i in idx if a[i] == learner]
            mu = sum(own) / len(own) if own else mean
        var = sum((x - mean) ** 2 for x in rs) / (len(rs) - 1) if len(rs) > 1 else 0.0
        for i in idx:
            out[i] = (r[i] - mu) / (math.sqrt(var) + eps)
    return out


@pytest.mark.parametrize("n", [3, 4])
def test_n_agents_random_pool_matches_loop(n):
    g = torch.Generator().manual_seed(n)
    G, P = 3, 7
    N = n * G * P
    r = (torch.rand(N, generator=g) < 0.4).double()
    r[: n * G] = 1.0  # a uniform all-correct group
    p = torch.arange(P).repeat_interleave(n * G)
    a = torch.arange(n).repeat_interleave(G).repeat(P)
    phat = torch.rand(n, generator=g, dtype=torch.float64) + 0.05
    om = (phat[:, None] / phat[None, :]).clamp(0.1, 10)
    for learner in range(n):
        A = hacpo_advantages(r, p, a, learner=learner, ratios=om)
        ref = _loop_reference(r.tolist(), p.tolist(), a.tolist(), learner, om.tolist())
        torch.testing.assert_close(A, torch.tensor(ref, dtype=torch.float64), rtol=1e-12,
                                   atol=1e-12)


def test_group_advantages_by_hand_and_dtype():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.float32)
    p = torch.tensor([7, 7, 7, 7, 3, 3])  # arbitrary ids, group {3} uniform
    A = group_advantages(r, p)
    assert A.dtype == torch.float32
    torch.testing.assert_close(A, torch.tensor([0.25, -0.75, 0.25, 0.25, 0.0, 0.0]) / SIG)


def test_uniform_groups_give_zero_advantages():
    for val in (0.0, 1.0, 0.3):
        r = torch.full((8,), val, dtype=torch.float64)
        p = torch.tensor([0] * 4 + [1] * 4)
        a = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
        om = torch.tensor([[1, 10, 0.1], [0.1, 1, 0.01], [10, 100, 1]], dtype=torch.float64)
        assert torch.equal(hacpo_advantages(r, p, a, learner=1, ratios=om.clamp(0.1, 10)),
                           torch.zeros(8, dtype=torch.float64))
        assert torch.equal(group_advantages(r, p), torch.zeros(8, dtype=torch.float64))


@pytest.mark.parametrize("val", [0.1, 0.3, 0.7, 0.9])
@pytest.mark.parametrize("size", [8, 12, 16])
def test_uniform_float32_groups_give_exactly_zero(val, size):
    """Fractional uniform rewards in float32 (the trainer's dtype): sum / count rounds away from
    the value (8 x 0.1 -> 0.1 + 7e-9), which sigma = eps blew up to |A| ~ 1e-2..1e-1."""
    r = torch.full((size,), val, dtype=torch.float32)
    p = torch.zeros(size, dtype=torch.long)
    a = torch.arange(size) % 2
    assert torch.equal(group_advantages(r, p), torch.zeros(size))
    for learner in (0, 1):
        assert torch.equal(hacpo_advantages(r, p, a, learner=learner, ratios=OMEGA2),
                           torch.zeros(size))


@pytest.mark.parametrize("eps", [0.0, -1e-6, float("nan"), float("inf")])
def test_eps_must_be_positive(eps):
    """eps = 0 made uniform and one-sample groups 0 / 0 = NaN advantages; an infinite eps made
    every advantage 0 (no gradient at all)."""
    r, p = torch.tensor([1.0, 1.0, 0.5]), torch.tensor([0, 0, 1])
    with pytest.raises(ValueError, match="eps must be finite and > 0"):
        group_advantages(r, p, eps=eps)
    with pytest.raises(ValueError, match="eps must be finite and > 0"):
        hacpo_advantages(r, p, torch.tensor([0, 1, 0]), learner=0, ratios=OMEGA2, eps=eps)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8])
def test_narrow_prompt_ids_keep_their_groups(dtype):
    """Prompt ids of any integer dtype are grouped as their values: an int8 span past 127
    (-100 .. 45) wrapped in the dense compaction and merged two uniform groups into one with
    nonzero advantages."""
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    ids = [-100, -100, -65, -65, 45, 45] if dtype != torch.uint8 else [0, 0, 130, 130, 255, 255]
    p = torch.tensor(ids, dtype=dtype)
    want = group_advantages(r, p.long())
    assert want[2:].tolist() == [0.0] * 4           # two uniform groups
    torch.testing.assert_close(group_advantages(r, p), want, rtol=0, atol=0)
    a = torch.tensor([0, 1, 0, 1, 0, 1])
    torch.testing.assert_close(hacpo_advantages(r, p, a, learner=0, ratios=OMEGA2),
                               hacpo_advantages(r, p.long(), a, learner=0, ratios=OMEGA2),
                               rtol=0, atol=0)


def test_single_sample_groups_are_finite_zero():
    r = torch.tensor([1.0, 0.0, 1.0])
    p = torch.tensor([0, 1, 2])
    a = torch.tensor([0, 1, 1])
    A = hacpo_advantages(r, p, a, learner=0, ratios=OMEGA2.float())
    assert torch.equal(A, torch.zeros(3))
    assert torch.equal(group_advantages(r, p), torch.zeros(3))


def test_all_self_and_all_cross_pools():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    p = torch.zeros(4, dtype=torch.long)
    # all self (learner 0): w = 1 -> plain group advantages
    A = hacpo_advantages(r, p, torch.zeros(4, dtype=torch.long), learner=0, ratios=OMEGA2)
    torch.testing.assert_close(A, group_advantages(r, p), rtol=0, atol=0)
    # all cross (only agent1's samples, learner 0): w = 2 -> mu = 1.0, not > 1, no guard
    A = hacpo_advantages(r, p, torch.ones(4, dtype=torch.long), learner=0, ratios=OMEGA2)
    sig = math.sqrt(1 / 3) + 1e-6
    torch.testing.assert_close(A, (r - 1.0) / sig)
    # all cross with mu > 1 and no own samples: fall back to the plain mean [ours]
    om = torch.tensor([[1.0, 4.0], [0.25, 1.0]], dtype=torch.float64)
    A = hacpo_advantages(r, p, torch.ones(4, dtype=torch.long), learner=0, ratios=om)
    torch.testing.assert_close(A, (r - 0.5) / sig)


def test_device_dtype_preserved_and_zero_reward_agent_finite():
    r = torch.zeros(6, dtype=torch.float32)
    r[0] = 1.0
    p = torch.tensor([0, 0, 0, 1, 1, 1])
    a = torch.tensor([0, 1, 1, 0, 1, 1])
    om = torch.tensor([[1.0, 10.0], [0.1, 1.0]], dtype=torch.float64)  # agent1 floored
    for learner in (0, 1):
        A = hacpo_advantages(r, p, a, learner=learner, ratios=om)
        assert A.dtype == torch.float32 and A.device == r.device
        assert torch.isfinite(A).all()


def test_validation_errors():
    r, p, a = _group4()
    with pytest.raises(ValueError, match=r"sample 2 \(prompt 0, agent 1\)"):
        hacpo_advantages(torch.tensor([1.0, 0.0, 2.0, 1.0]), p, a, learner=0, ratios=OMEGA2)
    with pytest.raises(ValueError, match="sample 1"):
        group_advantages(torch.tensor([0.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="agent index 5 of sample 3"):
        hacpo_advantages(r, p, torch.tensor([0, 0, 1, 5]), learner=0, ratios=OMEGA2)
    for bad in (2, -1, 0.5, True):      # 0.5 acted as learner 0
        with pytest.raises(ValueError, match=r"learner must be an agent index in 0\.\.1, got "):
            hacpo_advantages(r, p, a, learner=bad, ratios=OMEGA2)
    with pytest.raises(ValueError, match="shape mismatch"):
        hacpo_advantages(r, p[:3], a, learner=0, ratios=OMEGA2)
    with pytest.raises(ValueError, match="cross_baseline"):
        hacpo_advantages(r, p, a, learner=0, ratios=OMEGA2, cross_baseline="mean")


@pytest.mark.parametrize("bad", [0.0, -2.0, float("nan"), float("inf")])
def test_bad_capability_ratios_are_an_error(bad):
    # ratios feed w = 1 / omega: a zero, negative, NaN or infinite entry gave NaN or garbage
    # advantages silently (e.g. ratios[1, 0] = 0 -> A = [nan, nan, nan, nan]).
    r, p, a = _group4()
    om = OMEGA2.clone()
    om[1, 0] = bad
    with pytest.raises(ValueError, match=r"ratios\[1, 0\]"):
        hacpo_advantages(r, p, a, learner=0, ratios=om)
    # validate=False skips the host sync (and the check) for callers that trust their ratios
    hacpo_advantages(r, p, a, learner=0, ratios=om, validate=False)


def test_sparse_and_dense_prompt_ids_agree():
    g = torch.Generator().manual_seed(5)
    r = (torch.rand(48, generator=g) < 0.5).double()
    dense = torch.arange(6).repeat_interleave(8)
    sparse = dense * 10**12 - 7          # forces the sort-based path
    a = torch.arange(2).repeat_interleave(4).repeat(6)
    om = torch.tensor([[1.0, 3.0], [1 / 3, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(hacpo_advantages(r, sparse, a, learner=1, ratios=om),
                               hacpo_advantages(r, dense, a, learner=1, ratios=om), rtol=0, atol=0)
    torch.testing.assert_close(group_advantages(r, sparse), group_advantages(r, dense),
                               rtol=0, atol=0)
