"""The config -> math glue: which samples each algorithm trains on, minibatch splits."""
import pytest
import torch

from hacpo.engine import CapabilityTracker, group_advantages, hacpo_advantages, preset
from hacpo.engine.algorithm import learner_loss, learner_samples, sample_omega, split_minibatches


def _pool():
    # 2 prompts x 2 agents x G = 2
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    p = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    a = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])
    t = CapabilityTracker(2)
    t.update(r, a)
    return r, p, a, t.ratios()


def test_learner_samples_per_algorithm():
    r, p, a, om = _pool()
    idx, A = learner_samples(preset("gspo"), r, p, a, learner=1, ratios=om)
    assert idx.tolist() == [2, 3, 6, 7]
    torch.testing.assert_close(A, group_advantages(r[idx], p[idx]))
    idx, A = learner_samples(preset("naive"), r, p, a, learner=1, ratios=om)
    assert idx.tolist() == list(range(8))
    torch.testing.assert_close(A, group_advantages(r, p))
    idx, A = learner_samples(preset("hacpo"), r, p, a, learner=0, ratios=om)
    torch.testing.assert_close(A, hacpo_advantages(r, p, a, learner=0, ratios=om))
    _, A_off = learner_samples(preset("hacpo-no-capability-baseline"), r, p, a, learner=0,
                               ratios=om)
    torch.testing.assert_close(A_off, hacpo_advantages(r, p, a, learner=0,
                                                       ratios=torch.ones(2, 2)))
    assert not torch.equal(A_off, A)   # Phat differ (0.75 vs 0.5): the baseline matters
    w = sample_omega(preset("hacpo"), a, 0, om)
    torch.testing.assert_close(w, om[a, 0].float())
    assert torch.equal(sample_omega(preset("hacpo-no-capability-coefficient"), a, 0, om),
                       torch.ones(8))


def test_split_minibatches_mixed_and_self_first():
    p = torch.arange(6).repeat_interleave(4)        # 6 prompts x 4 samples
    is_self = torch.tensor([True, True, False, False]).repeat(6)
    g = torch.Generator().manual_seed(0)
    mbs = split_minibatches(p, is_self, 3, "mixed", g)
    assert len(mbs) == 3 and sorted(torch.cat(mbs).tolist()) == list(range(24))
    for mb in mbs:  # whole prompts, 2 per minibatch, self and cross together
        prompts = p[mb].unique()
        assert prompts.numel() == 2 and mb.numel() == 8
    g2 = torch.Generator().manual_seed(0)
    assert all(torch.equal(x, y) for x, y in zip(mbs, split_minibatches(p, is_self, 3, "mixed", g2)))
    sf = split_minibatches(p, is_self, 4, "self_first")
    assert [m.numel() for m in sf] == [6, 6, 6, 6]
    assert is_self[torch.cat(sf[:2])].all() and not is_self[torch.cat(sf[2:])].any()


def test_self_first_spreads_the_remainder_over_the_first_minibatches():
    """N = 10 into M = 4: one extra sample to each of the first N % M minibatches (3, 3, 2, 2),
    not the whole remainder to one; N = 2 < M = 4: two one-sample minibatches, empty ones
    dropped."""
    is_self = torch.tensor([True] * 4 + [False] * 6)
    sf = split_minibatches(torch.arange(10), is_self, 4, "self_first")
    assert [m.numel() for m in sf] == [3, 3, 2, 2]
    assert torch.cat(sf).tolist() == list(range(10))
    sf = split_minibatches(torch.arange(2), torch.tensor([True, False]), 4, "self_first")
    assert [m.tolist() for m in sf] == [[0], [1]]


def test_learner_loss_dispatch():
    N = 4
    z = torch.zeros(N)
    A = torch.tensor([1.0, -1.0, 0.5, 2.0])
    is_self = torch.tensor([True, True, False, False])
    l_h, m_h = learner_loss(preset("hacpo"), new_lp=z, old_lp=z, advantages=A, is_self=is_self,
                            omega=torch.tensor([1.0, 1.0, 2.0, 0.5]), minibatch_index=0)
    assert l_h.item() == -(1 - 1 + 1.0 + 1.0) / 4 and "cross_ratio_mean" in m_h
    l_g, m_g = learner_loss(preset("gspo"), new_lp=z, old_lp=z, advantages=A, is_self=is_self,
                            omega=torch.ones(N), minibatch_index=0)
    assert l_g.item() == -(2.5) / 4 and "cross_ratio_mean" not in m_g
    tok = torch.zeros(N, 3)
    l_r, _ = learner_loss(preset("grpo"), new_lp=None, old_lp=None, advantages=A, is_self=None,
                          omega=None, minibatch_index=0, token_logp=tok, old_token_logp=tok,
                          mask=torch.ones(N, 3, dtype=torch.bool))
    assert l_r.item() == -2.5 / 4


def test_naive_reports_self_and_cross_ratios_apart():
    """naive trains one GSPO objective on self and cross rows; its self ratio metrics are the
    self rows' (a cross row's ratio is against another model's log-probs), cross reported
    apart."""
    new = torch.zeros(4)
    old = torch.tensor([0.0, 0.0, -1.0, -2.0])      # ratios 1, 1, e, e^2
    is_self = torch.tensor([True, True, False, False])
    A = torch.ones(4)
    _, m = learner_loss(preset("naive"), new_lp=new, old_lp=old, advantages=A, is_self=is_self,
                        omega=torch.ones(4), minibatch_index=0)
    assert m["self_ratio_mean"].item() == 1.0 and m["self_clip_frac"].item() == 0.0
    assert abs(m["cross_ratio_mean"].item() - (2.718281828 + 7.389056099) / 2) < 1e-5
    assert m["cross_clip_frac"].item() == 1.0
    assert m["self_count"].item() == 2 and m["cross_count"].item() == 2
    l_g, _ = learner_loss(preset("gspo"), new_lp=new, old_lp=old, advantages=A,
                          is_self=is_self, omega=torch.ones(4), minibatch_index=0)
    l_n, _ = learner_loss(preset("naive"), new_lp=new, old_lp=old, advantages=A,
                          is_self=is_self, omega=torch.ones(4), minibatch_index=0)
    assert l_n.item() == l_g.item()                  # the loss itself is unchanged


def test_missing_inputs_of_an_algorithm_are_named():
    """hacpo without ratios and grpo without token log-probs raised AttributeError on None."""
    r, p, a = torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"hacpo needs the capability ratios \[n, n\]"):
        learner_samples(preset("hacpo"), r, p, a, learner=0, ratios=None)
    lp = torch.tensor([-1.0, -2.0])
    with pytest.raises(ValueError, match="grpo's loss is per token: it needs token_logp"):
        learner_loss(preset("grpo"), new_lp=lp, old_lp=lp, advantages=torch.tensor([1.0, -1.0]),
                     is_self=torch.tensor([True, True]), omega=torch.ones(2), minibatch_index=0)
