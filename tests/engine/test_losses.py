"""Losses: hand-computed values, SPEC invariants (incl. the stop-gradient one via autograd),
gradcheck in float64, micro-batch invariance in-process."""
import math

import numpy as np
import pytest
import torch

from hacpo.engine import (CapabilityTracker, grpo_policy_loss, gspo_policy_loss,
                          hacpo_advantages, group_advantages, hacpo_policy_loss,
                          sequence_mean_logprob)
from hacpo.engine.losses import cross_lower_bound

F64 = torch.float64


def _t(x, **kw):
    return torch.tensor(x, dtype=F64, **kw)


@pytest.mark.parametrize("m,expected", [(0, 0.8), (1, 0.825), (3, 0.875), (7, 0.975), (8, 1.0),
                                        (12, 1.0)])
def test_stepwise_lower_bound_default(m, expected):
    assert cross_lower_bound("stepwise", m, 0.2, 0.025) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("m,expected", [(0, 0.2), (4, 0.3), (32, 1.0)])
def test_stepwise_lower_bound_table5(m, expected):
    assert cross_lower_bound("stepwise", m, 0.8, 0.025) == pytest.approx(expected, abs=1e-12)


def test_cross_objective_by_hand():
    # s = 0.9 (log_s = log 0.9), A = 2, omega = 0.5, alpha = 1
    old = _t([0.0])
    A, om, self_ = _t([2.0]), _t([0.5]), torch.tensor([False])
    new = _t([math.log(0.9)], requires_grad=True)
    loss, met = hacpo_policy_loss(new, old, A, self_, om, minibatch_index=0)
    # m = 0: lo = 0.8, c = 0.9, obj = 0.9 * 0.9 * 0.5 * 2 = 0.81
    assert loss.item() == pytest.approx(-0.81, abs=1e-12)
    loss.backward()
    assert new.grad.item() == pytest.approx(-0.81, abs=1e-12)   # -(c^2 * omega * A)
    assert met["cross_clip_low_frac"].item() == 0.0
    # m = 6: lo = 0.95 -> c = 0.95, obj = 0.9025, gradient 0
    new = _t([math.log(0.9)], requires_grad=True)
    loss, met = hacpo_policy_loss(new, old, A, self_, om, minibatch_index=6)
    assert loss.item() == pytest.approx(-0.9025, abs=1e-12)
    loss.backward()
    assert new.grad.item() == 0.0
    assert met["cross_clip_low_frac"].item() == 1.0
    # s = 1.2 > 1: c = 1, obj = 1 * 1 * 0.5 * 2 = 1, gradient 0
    new = _t([math.log(1.2)], requires_grad=True)
    loss, met = hacpo_policy_loss(new, old, A, self_, om, minibatch_index=0)
    assert loss.item() == pytest.approx(-1.0, abs=1e-12)
    loss.backward()
    assert new.grad.item() == 0.0 and met["cross_clip_high_frac"].item() == 1.0


def test_self_objective_by_hand_and_ratio_clamp():
    old = _t([0.0, 0.0, 0.0, 0.0])
    new = _t([math.log(1.001), math.log(1.001), 1e-4, 50.0])   # last: log ratio clamped to 10
    A = _t([1.0, -1.0, 3.0, -1.0])
    loss, met = hacpo_policy_loss(new, old, A, torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=F64),
                                  minibatch_index=0)
    # A>0 above the clip: min(1.001, 1.0004) = 1.0004; A<0: min(-1.001, -1.0004) = -1.001;
    # inside the range: exp(1e-4) * 3; clamped log ratio: -exp(10)
    expected = -(1.0004 - 1.001 + 3 * math.exp(1e-4) - math.exp(10.0)) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert met["self_clip_frac"].item() == pytest.approx(0.75)
    gl, _ = gspo_policy_loss(new, old, A)
    assert gl.item() == pytest.approx(expected, rel=1e-12)


def test_grpo_by_hand():
    lp = _t([[math.log(1.5), 0.0, 0.0], [math.log(0.5), math.log(0.9), 0.0]])
    old = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    A = _t([1.0, -2.0])
    loss, met = grpo_policy_loss(lp, old, mask, A)
    # row0: min(1.5, 1.28) = 1.28, 1; row1 (A=-2): min(-1.0, -1.6) = -1.6, min(-1.8,-1.8),
    # min(-2, -2) -> token mean over 5 tokens
    expected = -(1.28 + 1.0 - 1.6 - 1.8 - 2.0) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert met["token_clip_frac"].item() == pytest.approx(2 / 5)


def test_grpo_extreme_token_log_ratio_is_finite():
    # A token whose log-ratio overflows exp (> 88 in float32: old log-prob -100, e.g. a token
    # the generator sampled at ~0 probability) made the GRPO loss NaN (inf * A=0, a uniform
    # group) or its gradient NaN (the clipped branch's 0 * inf), so the whole update was skipped.
    # The token log-ratio is clamped like the sequence ratio (verl's +-20 for token ratios):
    # outside it the gradient is zero, and the value is the clamped ratio's.
    old = torch.tensor([[-100.0, -1.0], [-1.0, 100.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    lim = 20.0
    for A in (0.0, 1.0, -1.0):
        tl = torch.tensor([[0.0, -1.0], [-1.0, 0.0]], requires_grad=True)
        loss, met = grpo_policy_loss(tl, old, mask, torch.tensor([A, A]))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(tl.grad).all(), (A, loss, tl.grad)
        assert all(torch.isfinite(v) for v in met.values())
        r_hi, r_lo = math.exp(lim), math.exp(-lim)
        # tokens: ratio e^20 (clamped), 1, 1, e^-20 (clamped); min(r*A, clip(r)*A) each
        objs = [min(r * A, min(max(r, 0.8), 1.28) * A) for r in (r_hi, 1.0, 1.0, r_lo)]
        assert loss.item() == pytest.approx(-sum(objs) / 4, rel=1e-6, abs=1e-6)
        # clamped tokens have no gradient; the ratio-1 tokens have d obj/d logp = A
        assert tl.grad.flatten().tolist() == pytest.approx([0.0, -A / 4, -A / 4, 0.0], abs=1e-7)
    # inside the clamp nothing changes: log-ratio 19 with A = -1 keeps PPO's unclipped gradient
    tl = torch.tensor([[19.0]], dtype=F64, requires_grad=True)
    loss, _ = grpo_policy_loss(tl, torch.zeros(1, 1, dtype=F64), torch.ones(1, 1, dtype=torch.bool),
                               _t([-1.0]))
    loss.backward()
    assert tl.grad.item() == pytest.approx(math.exp(19.0), rel=1e-12)


def test_grpo_explicit_zero_divisor_is_an_error():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="divisor"):
        grpo_policy_loss(z, z, torch.ones(1, 2, dtype=torch.bool), torch.ones(1), divisor=0)


@pytest.mark.parametrize("divisor", [torch.tensor(0), torch.tensor(-2.0), np.int64(0),
                                     np.float32(-1.0), math.nan, math.inf, torch.tensor(math.nan)])
def test_a_divisor_that_is_no_count_is_an_error(divisor):
    """A count passed as a CPU tensor (a mask's sum) or a numpy number is checked like an int:
    a zero one gave a NaN or -inf loss, a negative one flipped the loss's sign."""
    lp, A = _t([-1.0, -2.0]), _t([1.0, -0.5])
    for loss in (lambda d: gspo_policy_loss(lp + 0.1, lp, A, divisor=d),
                 lambda d: hacpo_policy_loss(lp + 0.1, lp, A, torch.tensor([True, False]),
                                             _t([1.0, 1.0]), minibatch_index=0, divisor=d),
                 lambda d: grpo_policy_loss(lp[:, None], lp[:, None] - 0.1,
                                            torch.ones(2, 1, dtype=torch.bool), A, divisor=d)):
        with pytest.raises(ValueError, match="loss divisor must be finite and > 0"):
            loss(divisor)


def test_a_divisor_is_one_count():
    lp, A = _t([-1.0, -2.0]), _t([1.0, -0.5])
    with pytest.raises(ValueError, match=r"loss divisor must be one count, got a torch.int64 "
                                         r"tensor of shape \(2,\)"):
        gspo_policy_loss(lp + 0.1, lp, A, divisor=torch.tensor([2, 2]))
    with pytest.raises(TypeError, match="loss divisor must be a number"):
        gspo_policy_loss(lp + 0.1, lp, A, divisor="2")
    # True is no count (it divided by 1); a bool tensor neither
    with pytest.raises(TypeError, match="loss divisor must be a number or a one-element "
                                        "tensor, got True"):
        gspo_policy_loss(lp + 0.1, lp, A, divisor=True)
    with pytest.raises(ValueError, match="one count, got a torch.bool tensor"):
        gspo_policy_loss(lp + 0.1, lp, A, divisor=torch.tensor(True))
    # a [1] count keeps the loss a scalar (it was [1])
    assert gspo_policy_loss(lp + 0.1, lp, A, divisor=torch.tensor([4]))[0].shape == ()
    # counts of every accepted kind give the same loss as the int
    want = gspo_policy_loss(lp + 0.1, lp, A, divisor=4)[0]
    for d in (4.0, np.int64(4), torch.tensor(4), torch.tensor([4])):
        torch.testing.assert_close(gspo_policy_loss(lp + 0.1, lp, A, divisor=d)[0].reshape(()),
                                   want, rtol=0, atol=0)


@pytest.mark.parametrize("kw,match", [({"alpha": math.nan}, "alpha must be finite and >= 0"),
                                      ({"alpha": math.inf}, "alpha must be finite and >= 0"),
                                      ({"max_abs_log_ratio": math.inf},
                                       "max_abs_log_ratio must be finite and > 0"),
                                      ({"cross_clip_step": math.inf},
                                       "cross_clip_step must be finite and >= 0")])
def test_hacpo_loss_refuses_non_finite_settings(kw, match):
    """alpha = NaN passed the old `alpha < 0` check and made a NaN loss whenever a cross
    ratio was clipped below 1."""
    lp, A = _t([-1.0, -2.0]), _t([1.0, -0.5])
    with pytest.raises(ValueError, match=match):
        hacpo_policy_loss(lp + 0.1, lp, A, torch.tensor([True, False]), _t([1.0, 1.0]),
                          minibatch_index=0, **kw)


def test_sequence_mean_logprob():
    tl = _t([[-1.0, -2.0, -9.0], [-0.5, -0.5, -2.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    torch.testing.assert_close(sequence_mean_logprob(tl, m), _t([-1.5, -1.0]))
    with pytest.raises(ValueError, match="sequence 1 has no tokens"):
        sequence_mean_logprob(tl, torch.tensor([[1, 0, 0], [0, 0, 0]], dtype=torch.bool))
    with pytest.raises(ValueError, match="shape mismatch"):
        sequence_mean_logprob(tl, m[:, :2])


def test_one_agent_hacpo_equals_gspo_exactly():
    g = torch.Generator().manual_seed(0)
    N = 64
    r = (torch.rand(N, generator=g) < 0.5).float()
    p = torch.arange(N) // 8
    a = torch.zeros(N, dtype=torch.long)
    tracker = CapabilityTracker(1)
    tracker.update(r, a)
    A_h = hacpo_advantages(r, p, a, learner=0, ratios=tracker.ratios())
    A_g = group_advantages(r, p)
    assert torch.equal(A_h, A_g)
    old = torch.randn(N, generator=g) * 0.01
    base = old + torch.randn(N, generator=g) * 1e-3
    new_h = base.clone().requires_grad_()
    new_g = base.clone().requires_grad_()
    lh, mh = hacpo_policy_loss(new_h, old, A_h, torch.ones(N, dtype=torch.bool), torch.ones(N),
                               minibatch_index=3)
    lg, mg = gspo_policy_loss(new_g, old, A_g)
    lh.backward(); lg.backward()
    assert torch.equal(lh, lg)
    assert torch.equal(new_h.grad, new_g.grad)
    assert torch.equal(mh["self_clip_frac"], mg["self_clip_frac"])


def test_alpha0_no_coefficient_no_clip_is_s_times_A():
    g = torch.Generator().manual_seed(1)
    new = (torch.randn(16, generator=g, dtype=F64) * 0.5).requires_grad_()
    old = torch.randn(16, generator=g, dtype=F64) * 0.5
    A = torch.randn(16, generator=g, dtype=F64)
    loss, _ = hacpo_policy_loss(new, old, A, torch.zeros(16, dtype=torch.bool),
                                torch.ones(16, dtype=F64), minibatch_index=0, alpha=0.0,
                                cross_clip="none")
    expected = -(torch.exp(new - old) * A).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-14, atol=0)
    gl, = torch.autograd.grad(loss, new)
    ge, = torch.autograd.grad(expected, new)
    torch.testing.assert_close(gl, ge, rtol=1e-14, atol=0)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 2.0])
def test_cross_gradient_is_c_pow_1_plus_alpha(alpha):
    # log ratios spanning below lo (0.8), inside [0.8, 1], and above 1
    log_s = _t([math.log(0.5), math.log(0.79), math.log(0.81), math.log(0.9), math.log(0.99),
                math.log(1.01), math.log(1.5)], requires_grad=True)
    N = log_s.numel()
    A = _t([1.5, -2.0, 0.7, -0.3, 2.0, 1.0, -1.0])
    om = _t([0.5, 2.0, 1.0, 10.0, 0.1, 3.0, 1.0])
    obj_sum = -hacpo_policy_loss(log_s, torch.zeros(N, dtype=F64), A, torch.zeros(N, dtype=torch.bool),
                                 om, minibatch_index=0, alpha=alpha, divisor=1)[0]
    grad, = torch.autograd.grad(obj_sum, log_s)
    s = torch.exp(log_s.detach())
    inside = (s >= 0.8) & (s <= 1.0)
    expected = torch.where(inside, s.pow(1 + alpha) * om * A, torch.zeros_like(s))
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    assert inside.tolist() == [False, False, True, True, True, False, False]


def test_gradcheck_all_losses():
    g = torch.Generator().manual_seed(2)
    N = 10
    old = torch.randn(N, generator=g, dtype=F64) * 0.1
    # self ratios well inside or outside the tiny clip range; cross ratios away from 0.8 and 1
    log_s = _t([1e-4, -5e-5, 0.2, -0.3, -0.1, -0.05, -0.6, 0.4, -0.15, 0.02])
    is_self = torch.tensor([True] * 4 + [False] * 6)
    new = (old + log_s).requires_grad_()
    A = torch.randn(N, generator=g, dtype=F64)
    om = torch.rand(N, generator=g, dtype=F64) + 0.5

    # gradcheck compares against finite differences, which see through the stop-gradient in
    # c * sg(c)^alpha; with alpha = 0 the two agree, and alpha > 0 is covered exactly by
    # test_cross_gradient_is_c_pow_1_plus_alpha (which checks that they must differ).
    def hacpo_f(x):
        return hacpo_policy_loss(x, old, A, is_self, om, minibatch_index=1, alpha=0.0)[0]

    def hacpo_static_f(x):
        return hacpo_policy_loss(x, old, A, is_self, om, minibatch_index=0, alpha=0.0,
                                 cross_clip="static", cross_clip_delta=0.5)[0]

    # with alpha = 1 the finite-difference gradient is (1 + alpha) c^alpha ... != autograd's
    num_vs_auto = torch.autograd.gradcheck(
        lambda x: hacpo_policy_loss(x, old, A, is_self, om, minibatch_index=1, alpha=1.0)[0],
        (new,), raise_exception=False)
    assert not num_vs_auto

    def gspo_f(x):
        return gspo_policy_loss(x, old, A)[0]

    assert torch.autograd.gradcheck(hacpo_f, (new,))
    assert torch.autograd.gradcheck(hacpo_static_f, (new,))
    assert torch.autograd.gradcheck(gspo_f, (new,))
    tl = (torch.randn(3, 5, generator=g, dtype=F64) * 0.1).requires_grad_()
    old_t = tl.detach() + torch.tensor([0.05, -0.5, 0.3, 0.0, 0.1], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    Ag = torch.randn(3, generator=g, dtype=F64)
    assert torch.autograd.gradcheck(lambda x: grpo_policy_loss(x, old_t, mask, Ag)[0], (tl,))
    assert torch.autograd.gradcheck(lambda x: sequence_mean_logprob(x, mask), (tl,))


def test_microbatch_split_invariance_in_process():
    g = torch.Generator().manual_seed(3)
    N = 24
    old = torch.randn(N, generator=g, dtype=F64) * 0.1
    new = (old + torch.randn(N, generator=g, dtype=F64) * 0.1).requires_grad_()
    A = torch.randn(N, generator=g, dtype=F64)
    is_self = torch.rand(N, generator=g) < 0.5
    om = torch.rand(N, generator=g, dtype=F64) + 0.5
    full, _ = hacpo_policy_loss(new, old, A, is_self, om, minibatch_index=2)
    gfull, = torch.autograd.grad(full, new)
    parts = [slice(0, 5), slice(5, 17), slice(17, 24)]
    total = sum(hacpo_policy_loss(new[s], old[s], A[s], is_self[s], om[s], minibatch_index=2,
                                  divisor=N)[0] for s in parts)
    gsplit, = torch.autograd.grad(total, new)
    torch.testing.assert_close(total, full, rtol=1e-14, atol=0)
    torch.testing.assert_close(gsplit, gfull, rtol=1e-14, atol=0)


def test_all_self_all_cross_metrics_finite():
    N = 6
    z = torch.zeros(N)
    for is_self in (torch.ones(N, dtype=torch.bool), torch.zeros(N, dtype=torch.bool)):
        loss, met = hacpo_policy_loss(z, z, torch.ones(N), is_self, torch.ones(N),
                                      minibatch_index=0)
        assert torch.isfinite(loss)
        assert all(torch.isfinite(v).all() for v in met.values())
        assert loss.item() == pytest.approx(-1.0)


def test_loss_validation():
    z = torch.zeros(4)
    with pytest.raises(ValueError, match="shape mismatch"):
        hacpo_policy_loss(z, z[:3], z, z.bool(), z, minibatch_index=0)
    with pytest.raises(ValueError, match="cross_clip"):
        hacpo_policy_loss(z, z, z, z.bool(), z, minibatch_index=0, cross_clip="pessimistic")
    with pytest.raises(ValueError, match="alpha"):
        hacpo_policy_loss(z, z, z, z.bool(), z, minibatch_index=0, alpha=-1)
    with pytest.raises(ValueError, match="divisor"):
        gspo_policy_loss(z[:0], z[:0], z[:0])
    with pytest.raises(ValueError, match=r"advantages \[B\]"):
        grpo_policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(3))


@pytest.mark.parametrize("loss,setting,value", [
    ("hacpo", "cross_clip_delta", -0.1),   # static lo = 1.1 > 1 would pin every cross ratio
    ("hacpo", "cross_clip_delta", 1.5),    # lo < 0: no lower clip at all
    ("hacpo", "cross_clip_step", -0.025),  # the bound would loosen with m
    ("hacpo", "self_clip_low", 1.0),       # clip interval reaching 0
    ("hacpo", "self_clip_high", -1e-4),    # 1 + high < 1 - low: an empty interval
    ("hacpo", "max_abs_log_ratio", 0.0),   # every ratio would be 1
    ("hacpo", "self_clip_low", float("nan")),
    ("gspo", "clip_low", -3e-4),
    ("gspo", "clip_high", float("nan")),
    ("grpo", "clip_low", 1.2),             # 1 - low < 0 flips the clipped ratio's sign
    ("grpo", "max_abs_log_ratio", -20.0),
])
def test_clip_settings_out_of_range_are_errors_naming_them(loss, setting, value):
    z = torch.zeros(4)
    call = {"hacpo": lambda **kw: hacpo_policy_loss(z, z, z + 1, torch.tensor([1, 0, 1, 0]),
                                                   z + 1, minibatch_index=0,
                                                   cross_clip="static", **kw),
            "gspo": lambda **kw: gspo_policy_loss(z, z, z + 1, **kw),
            "grpo": lambda **kw: grpo_policy_loss(torch.zeros(2, 3), torch.zeros(2, 3),
                                                 torch.ones(2, 3), torch.ones(2), **kw)}[loss]
    call()                                              # the defaults are valid
    with pytest.raises(ValueError, match=f"^{setting} must be "):
        call(**{setting: value})


def test_padding_under_the_mask_is_never_read():
    """-inf or NaN log-probs at masked (padding) positions: x * 0 made the sequence means, the
    GRPO loss and the KL NaN, and exp's backward made the gradient NaN."""
    from hacpo.engine.losses import low_var_kl
    inf, nan = math.inf, math.nan
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    clean = _t([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    dirty = _t([[-1.0, -2.0, -inf], [-0.5, nan, nan]])
    old_clean = _t([[-1.1, -2.1, 0.0], [-0.4, 0.0, 0.0]])
    old_dirty = _t([[-1.1, -2.1, -inf], [-0.4, nan, -inf]])
    A = _t([1.0, -1.0])

    def run(lp, old):
        lp = lp.clone().requires_grad_(True)
        seq = sequence_mean_logprob(lp, m)
        g, _ = grpo_policy_loss(lp, old, m, A)
        kl = low_var_kl(lp, old, m)
        (seq.sum() + g + kl.sum()).backward()
        return seq.detach(), g.detach(), kl.detach(), lp.grad
    want, got = run(clean, old_clean), run(dirty, old_dirty)
    for w, x in zip(want, got):
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x, w, rtol=0, atol=0)
    assert got[3][~m].eq(0).all()


@pytest.mark.parametrize("bad", [math.nan, -5.0, 0.0, math.inf])
def test_hacpo_loss_refuses_capability_ratios_that_are_no_ratios(bad):
    """omega NaN made the loss NaN, a negative one flipped the cross gradient's sign and 0
    silently zeroed it (hacpo_advantages checks its ratios; the loss did not)."""
    lp, A = _t([0.0, 0.0, 0.0, 0.0]), _t([1.0, -1.0, 0.5, 2.0])
    is_self = torch.tensor([True, False, False, True])
    with pytest.raises(ValueError, match=r"omega\[1\] is .*: capability ratios must be finite "
                                         r"and > 0 \(1 bad of 4\)"):
        hacpo_policy_loss(lp, lp, A, is_self, _t([1.0, bad, 1.0, 1.0]), minibatch_index=0)


@pytest.mark.parametrize("m", [0.5, True, None, math.nan, -1, "1"])
def test_hacpo_loss_minibatch_index_is_a_whole_number(m):
    """0.5 gave an in-between stepwise bound, True acted as 1, None was a bare TypeError."""
    lp, A = _t([0.0, 0.0]), _t([1.0, -1.0])
    with pytest.raises(ValueError, match=r"minibatch_index must be a whole number >= 0"):
        hacpo_policy_loss(lp, lp, A, torch.tensor([True, False]), _t([1.0, 1.0]),
                          minibatch_index=m)
    loss, met = hacpo_policy_loss(lp, lp, A, torch.tensor([True, False]), _t([1.0, 1.0]),
                                  minibatch_index=np.int64(2))      # numpy integers are indexes
    assert float(met["cross_lower_bound"]) == pytest.approx(cross_lower_bound(
        "stepwise", 2, 0.2, 0.025), abs=1e-7)


def test_half_precision_sequence_means_do_not_overflow():
    """3000 tokens at -30 summed in float16 was -inf (and counts past 2048 rounded)."""
    lp = torch.full((2, 3001), -30.0, dtype=torch.float16)
    mask = torch.ones(2, 3001, dtype=torch.bool)
    mask[1, 1:] = False
    out = sequence_mean_logprob(lp, mask)
    assert out.dtype == torch.float16 and out.tolist() == [-30.0, -30.0]
    a = torch.tensor([1.0, -1.0], dtype=torch.float16)
    loss, _ = grpo_policy_loss(lp, lp, mask, a)       # ratio 1: -(3001 - 1) / 3002 tokens
    assert loss.dtype == torch.float16 and torch.isfinite(loss)
    assert float(loss) == pytest.approx(-3000 / 3002, rel=1e-3)


def test_grpo_with_no_masked_token_is_an_error_as_gspo_is():
    """An all-empty mask gave loss -0. silently; GSPO and HACPO with no sample are errors."""
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="an empty minibatch has no loss"):
        grpo_policy_loss(z, z, torch.zeros(2, 3, dtype=torch.bool), torch.ones(2))


def test_lists_and_arrays_for_tensors_are_type_errors_naming_them():
    """A list or a numpy array where SPEC asks for a tensor was an AttributeError about
    ``.dim`` / ``.bool``; it is a TypeError naming the argument."""
    z = torch.zeros(2)
    with pytest.raises(TypeError, match=r"new_lp must be a torch.Tensor, got list"):
        gspo_policy_loss([0.0, 1.0], z, z)
    with pytest.raises(TypeError, match=r"omega must be a torch.Tensor, got float"):
        hacpo_policy_loss(z, z, z, torch.tensor([True, False]), 1.0, minibatch_index=0)
    with pytest.raises(TypeError, match=r"mask must be a torch.Tensor, got ndarray"):
        grpo_policy_loss(z[None], z[None], np.ones((1, 2), dtype=bool), torch.ones(1))
    with pytest.raises(TypeError, match=r"rewards must be a torch.Tensor, got list"):
        CapabilityTracker(2).update([0.5, 1.0], torch.tensor([0, 1]))


def test_low_var_kl_clamps_the_log_ratio_before_exp():
    """d = ref - lp = 99 overflows exp in float32: without the clamp of d to [-20, 20] k3's clamp
    still caps the value at 10, but its backward is 0 * exp(d) = 0 * inf = NaN."""
    from hacpo.engine.losses import low_var_kl
    lp = torch.tensor([[-100.0]], requires_grad=True)
    kl = low_var_kl(lp, torch.tensor([[-1.0]]), torch.tensor([[True]]))
    assert kl.item() == 10.0
    kl.sum().backward()
    assert torch.isfinite(lp.grad).all() and lp.grad.item() == 0.0


def test_low_var_kl_log_ratio_clamp_is_20_not_10():
    """d = ref - lp = -16: k3 = exp(-16) + 16 - 1 ~ 15, capped at 10; clamping d to [-10, 10]
    instead would give exp(-10) + 9 ~ 9.00005."""
    from hacpo.engine.losses import low_var_kl
    kl = low_var_kl(_t([[0.0]]), _t([[-16.0]]), torch.tensor([[True]]))
    assert kl.item() == 10.0
    # inside both clamps: k3 = exp(-5) + 5 - 1 by hand
    kl = low_var_kl(_t([[0.0]]), _t([[-5.0]]), torch.tensor([[True]]))
    assert kl.item() == pytest.approx(math.exp(-5.0) + 4.0, rel=1e-12)


def test_cross_ratio_just_above_one_counts_as_clipped_above():
    """SPEC: a cross ratio is clamped to [lo_m, 1], so s = 1.0002 is clipped above (zero
    gradient) although it lies inside the self clip range (1 + 4e-4)."""
    old = _t([0.0, 0.0])
    new = _t([math.log(1.0002), math.log(1.0002)], requires_grad=True)
    loss, met = hacpo_policy_loss(new, old, _t([1.0, -2.0]), torch.tensor([False, False]),
                                  _t([1.0, 1.0]), minibatch_index=0)
    assert met["cross_clip_high_frac"].item() == 1.0
    assert met["cross_clip_low_frac"].item() == 0.0
    loss.backward()
    assert new.grad.eq(0).all()
