"""Tests written for mutants of the math that the other tests let through (mutation audit):
each test names what it pins. Expected values come from SPEC.md's formulas, evaluated here in
float64 or by hand, never from the code under test."""
import math

import numpy as np
import pytest
import torch

from hacpo.engine import hacpo_policy_loss, low_var_kl, preset
from hacpo.engine.algorithm import learner_loss, learner_samples, split_minibatches
from hacpo.engine.losses import cross_lower_bound, self_cross_ratio_metrics
from hacpo.engine.pool import LearnerView
from hacpo.engine.update import (NonFiniteUpdateError, UpdateMetrics, clip_coefficient,
                                 grad_norm_fp32, replay_nonfinite, step_clipped,
                                 update_learner)

from .test_spec_independent import ref_hacpo_advantages

F64 = torch.float64


# ---------------------------------------------------------------- cross clip metrics at edges
def _exact_log(x: float) -> float:
    """d with exp(d) == x exactly in float64 (torch.exp), so that s sits on a clip bound."""
    d = math.log(x)
    for _ in range(8):
        got = float(torch.exp(torch.tensor(d, dtype=F64)))
        if got == x:
            return d
        d = math.nextafter(d, math.inf if got < x else -math.inf)
    raise AssertionError(f"no float64 d with exp(d) == {x}")


@pytest.mark.parametrize("s_name", ["lower", "upper"])
def test_cross_ratio_on_a_clip_bound_is_inside(s_name):
    """SPEC: c = clamp(s, lo_m, 1) has gradient c^(1+alpha) omega A on the closed [lo_m, 1]; a
    cross ratio exactly on a bound is inside: it has that gradient and is not counted as
    clipped (a `<=` / `>=` in the clip fractions would count it)."""
    lo = cross_lower_bound("stepwise", 0, 0.2, 0.025)
    s = lo if s_name == "lower" else 1.0
    d = _exact_log(s) if s != 1.0 else 0.0
    old = torch.tensor([-1.0, -2.0], dtype=F64)
    new = (old + torch.tensor([d, 0.3], dtype=F64)).requires_grad_()
    A = torch.tensor([0.7, 1.0], dtype=F64)
    omega = torch.tensor([1.5, 1.0], dtype=F64)
    loss, met = hacpo_policy_loss(new, old, A, torch.tensor([False, True]), omega,
                                  minibatch_index=0)
    assert float(torch.exp(new.detach() - old)[0]) == s
    loss.backward()
    # loss = -mean(obj): d loss / d new_lp_0 = -c^2 * omega * A / 2 with c = s (alpha = 1)
    assert float(new.grad[0]) == pytest.approx(-(s ** 2) * 1.5 * 0.7 / 2, rel=1e-12)
    assert float(met["cross_clip_low_frac"]) == 0.0
    assert float(met["cross_clip_high_frac"]) == 0.0


def test_no_cross_clip_reports_no_lower_bound():
    """cross_clip='none' has no lower bound: it is reported as -inf (not 0, which would read as
    a bound of 0), and a tiny cross ratio is not counted as clipped."""
    assert cross_lower_bound("none", 3, 0.2, 0.025) == -math.inf
    new = torch.tensor([-30.0, 0.0], dtype=F64)
    old = torch.zeros(2, dtype=F64)
    _, met = hacpo_policy_loss(new, old, torch.ones(2, dtype=F64), torch.tensor([False, False]),
                               torch.ones(2, dtype=F64), minibatch_index=3, cross_clip="none")
    assert float(met["cross_lower_bound"]) == -math.inf
    assert float(met["cross_clip_low_frac"]) == 0.0


def test_naive_ratio_metrics_use_the_clamped_log_ratio():
    """The naive baseline's self / cross ratio metrics are of the ratio the loss uses,
    s = exp(clamp(lp_new - lp_old, -10, 10)) (SPEC "Sequence ratio")."""
    met = self_cross_ratio_metrics(torch.tensor([15.0, -12.0], dtype=F64),
                                   torch.zeros(2, dtype=F64), torch.tensor([True, False]))
    assert float(met["self_ratio_mean"]) == pytest.approx(math.exp(10.0), rel=1e-12)
    assert float(met["cross_ratio_mean"]) == pytest.approx(math.exp(-10.0), rel=1e-12)


# ---------------------------------------------------------------- KL estimator
def test_low_var_kl_masks_padding_and_clamps_per_token():
    """low_var_kl = per-sequence mean over the mask of k3 = exp(d) - d - 1, d = ref - lp clamped
    to [-20, 20], k3 clamped to [-10, 10] (reference implementation): padding values must not
    leak in, and a token with d = 5 (k3 = e^5 - 6 ~ 142) counts as 10."""
    lp = torch.tensor([[-1.0, -2.0, 7.0], [-0.5, -6.0, -3.0]], dtype=F64)
    ref = torch.tensor([[-1.5, 3.0, -9.0], [-0.25, -1.0, 40.0]], dtype=F64)
    mask = torch.tensor([[True, True, False], [True, False, False]])

    def k3(d):
        d = min(max(d, -20.0), 20.0)
        return min(max(math.exp(d) - d - 1, -10.0), 10.0)

    want = [(k3(-0.5) + k3(5.0)) / 2, k3(0.25)]
    assert k3(5.0) == 10.0
    torch.testing.assert_close(low_var_kl(lp, ref, mask), torch.tensor(want, dtype=F64),
                               rtol=1e-12, atol=0)


# ---------------------------------------------------------------- config switches reach the math
@pytest.mark.parametrize("switch", ["advantage.uniform_guard", "advantage.binary_guard"])
def test_advantage_guard_switches_reach_learner_samples(switch):
    """Each guard switched off in the config is off in the advantages learner_samples returns
    (SPEC's ablation switches), on a pool where each guard changes the result."""
    # learner 0 is 4x as capable as agent 1: agent 1's rewards get weight Phat(0)/Phat(1) = 4.
    # prompt 0: uniform 0.2 rewards, weighted mean 0.5 != 0.2 (the uniform guard's case);
    # prompt 1: weighted mean (0 + 1 + 4 + 4) / 4 > 1 (the binary guard's case)
    r = [0.2, 0.2, 0.2, 0.2, 0.0, 1.0, 1.0, 1.0]
    prompt = [0, 0, 0, 0, 1, 1, 1, 1]
    agent = [0, 0, 1, 1, 0, 0, 1, 1]
    omega = [[1.0, 4.0], [0.25, 1.0]]            # omega[s, t] = Phat(s) / Phat(t)
    cfg = preset("hacpo", {switch: False})
    adv = cfg.advantage
    _, A = learner_samples(cfg, torch.tensor(r, dtype=F64), torch.tensor(prompt),
                           torch.tensor(agent), learner=0, ratios=torch.tensor(omega, dtype=F64))
    ref = [np.array(r), np.array(prompt), np.array(agent), 0, np.array(omega)]
    want = ref_hacpo_advantages(*ref, ug=adv.uniform_guard, bg=adv.binary_guard).tolist()
    on = ref_hacpo_advantages(*ref).tolist()
    assert max(abs(a - b) for a, b in zip(want, on)) > 0.1      # the switch matters here
    torch.testing.assert_close(A, torch.tensor(want, dtype=F64), rtol=1e-9, atol=1e-9)


def test_loss_clip_settings_reach_learner_loss():
    """loss.self_clip_low / self_clip_high / cross_clip_step set in the config are the ones the
    HACPO loss uses; grpo's clip is [1 - 0.2, 1 + 0.28] (SPEC's table) in that order."""
    cfg = preset("hacpo", {"loss.self_clip_low": 0.05, "loss.self_clip_high": 0.07,
                           "loss.cross_clip_step": 0.1})
    # m = 1: lo = 1 - 0.2 + 0.1 = 0.9. Self ratios straddle [0.95, 1.07]; cross ratios [0.9, 1]
    s = torch.tensor([0.93, 0.97, 1.06, 1.09, 0.85, 0.95, 0.99], dtype=F64)
    A = torch.tensor([-1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -2.0], dtype=F64)
    is_self = torch.tensor([True, True, True, True, False, False, False])
    omega = torch.tensor([1, 1, 1, 1, 2.0, 0.5, 1.0], dtype=F64)
    old = torch.full((7,), -1.0, dtype=F64)
    new = (old + s.log()).requires_grad_()
    loss, _ = learner_loss(cfg, new_lp=new, old_lp=old, advantages=A, is_self=is_self,
                           omega=omega, minibatch_index=1)
    loss.backward()
    obj, grad = [], []                          # SPEC, d obj / d log s by hand
    for si, a, me, om in zip(s.tolist(), A.tolist(), is_self.tolist(), omega.tolist()):
        if me:                                  # min(s A, clip(s, 0.95, 1.07) A)
            c = min(max(si, 0.95), 1.07)
            obj.append(min(si * a, c * a))
            grad.append(si * a if (c == si or si * a < c * a) else 0.0)
        else:
            c = min(max(si, 0.9), 1.0)
            obj.append(c * c * om * a)
            grad.append(c * c * om * a if 0.9 <= si <= 1.0 else 0.0)
    assert float(loss.detach()) == pytest.approx(-sum(obj) / 7, rel=1e-12)
    torch.testing.assert_close(new.grad, -torch.tensor(grad, dtype=F64) / 7, rtol=1e-12, atol=0)

    g = preset("grpo")
    ratio = torch.tensor([[0.7, 1.1, 0.9], [1.25, 1.3, 1.5]], dtype=F64)
    adv = torch.tensor([-1.0, 1.0], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    old_t = torch.full((2, 3), -2.0, dtype=F64)
    tl = (old_t + ratio.log()).requires_grad_()
    loss, _ = learner_loss(g, new_lp=None, old_lp=None, advantages=adv, is_self=None,
                           omega=None, minibatch_index=0, token_logp=tl,
                           old_token_logp=old_t, mask=mask)
    loss.backward()
    want, grad = 0.0, torch.zeros(2, 3, dtype=F64)
    for b in range(2):
        for t in range(3):
            if mask[b, t]:
                x, a = float(ratio[b, t]), float(adv[b])
                c = min(max(x, 0.8), 1.28)
                want += min(x * a, c * a)
                grad[b, t] = x * a if (c == x or x * a < c * a) else 0.0
    assert float(loss.detach()) == pytest.approx(-want / 5, rel=1e-12)
    torch.testing.assert_close(tl.grad, -grad / 5, rtol=1e-12, atol=0)


def test_mixed_minibatches_are_shuffled_by_the_generator():
    """SPEC "Minibatches": mixed splits the prompts into M groups *shuffled with the run's
    seed*: the same seed gives the same split, and over seeds the prompts of the first
    minibatch vary (not always the lowest prompt ids)."""
    prompt = torch.arange(8).repeat_interleave(2)
    is_self = torch.tensor([True, False] * 8)

    def first(seed):
        mbs = split_minibatches(prompt, is_self, 2, "mixed", torch.Generator().manual_seed(seed))
        return frozenset(prompt[mbs[0]].tolist())

    assert first(3) == first(3)
    firsts = {first(seed) for seed in range(12)}
    assert len(firsts) > 3, firsts
    assert all(len(f) == 4 for f in firsts)


# ---------------------------------------------------------------- update_learner on a toy policy
class _NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


class _Toy(torch.nn.Module):
    """Per-token log-prob w + base[prompt[0]] at every response token (all real, no padding):
    a sample's mean log-prob is w + base, so its ratio is controlled exactly."""

    def __init__(self, base: dict, nan_grad: bool = False, name: str = "toy"):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros((), dtype=F64))
        self.base, self.nan_grad, self.name = base, nan_grad, name

    def response_logprobs(self, prompts, resps, temperature=1.0):
        T = max(len(r) for r in resps)
        b = torch.tensor([self.base[p[0]] for p in prompts], dtype=F64)[:, None]
        w = _NanGrad.apply(self.w) if self.nan_grad else self.w
        return (w + b).expand(len(resps), T), torch.ones(len(resps), T, dtype=torch.bool)


def _view(adv, is_self, prompts, omega=None):
    n = len(adv)
    return LearnerView(torch.arange(n), torch.tensor(adv, dtype=F64),
                       torch.tensor(omega or [1.0] * n, dtype=F64),
                       torch.tensor(is_self), [[p] for p in prompts], [[5, 6, 7]] * n, {})


def _update(algo, pol, view, lp_old, *, lr=1.0, **kw):
    kw.setdefault("nonfinite", {"streak": 0, "total": 0})
    return update_learner(algo, pol, torch.optim.SGD(pol.parameters(), lr=lr), view,
                          lp_old=lp_old, old_token_logp=[],
                          prompt_of_sample=torch.arange(view.idx.numel()),
                          generator=torch.Generator().manual_seed(0), micro_batch=8,
                          grad_clip=0.0, max_nonfinite=5, **kw)


@pytest.mark.parametrize("s,moves", [(0.81, False), (0.83, True)])
def test_update_uses_the_minibatch_index_for_the_stepwise_clip(s, moves):
    """Minibatch m = 1 holds one cross sample: its lower bound is lo_1 = 0.825, so a ratio
    of 0.81 is clipped (no gradient, the weight stays) and 0.83 is not (SGD moves the weight
    by lr * c^2 * omega * A, SPEC's gradient). Minibatch 0 (a self sample, A = 0) moves
    nothing."""
    algo = preset("hacpo", {"num_minibatches": 2, "minibatch_order": "self_first"})
    pol = _Toy({1: -1.0, 2: -2.0})
    view = _view([0.0, 0.5], [True, False], [1, 2], omega=[1.0, 2.0])
    lp_old = torch.tensor([-1.0, -2.0 - math.log(s)], dtype=F64)
    m = _update(algo, pol, view, lp_old)
    want = s * s * 2.0 * 0.5 if moves else 0.0
    assert float(pol.w.detach()) == pytest.approx(want, rel=1e-12, abs=0)
    assert m["cross_clip_low_frac"] == (0.0 if moves else 1.0)


def test_kl_penalty_is_on_self_samples_only():
    """SPEC: the KL to the reference policy applies to self samples only; its metric is the
    mean over self rows. One self and one cross row, both A = 0: the update's loss is
    kl_coef * k3(self) / 2 (sequence-mean loss over the minibatch's 2 rows)."""
    pol = _Toy({1: -1.0, 2: -3.0})
    ref = _Toy({1: -1.5, 2: -0.5}, name="ref")
    view = _view([0.0, 0.0], [True, False], [1, 2])
    m = _update(preset("hacpo", {"num_minibatches": 1}), pol, view,
                torch.tensor([-1.0, -3.0], dtype=F64), lr=0.0, ref_policy=ref, kl_coef=0.5)
    k3_self = math.exp(-0.5) + 0.5 - 1
    # metrics come over as float32: 1e-6 relative
    assert m["kl"] == pytest.approx(k3_self, rel=1e-6)
    assert m["loss"] == pytest.approx(0.5 * k3_self / 2, rel=1e-6)


def test_finite_loss_with_non_finite_gradient_is_skipped():
    """An update is applied only if its loss *and* gradient norm are finite: a finite loss with
    a NaN gradient is skipped (the weight is not made NaN) and counted."""
    pol = _Toy({1: -1.0}, nan_grad=True)
    state = {"streak": 0, "total": 0}
    m = _update(preset("gspo", {"num_minibatches": 1}), pol, _view([1.0], [True], [1]),
                torch.tensor([-1.0], dtype=F64), nonfinite=state)
    assert m["skipped_updates"] == 1 and state == {"streak": 1, "total": 1, "agents": {"toy": 1}}
    assert float(pol.w.detach()) == 0.0


def test_max_nonfinite_in_a_row_stops_at_the_limit():
    """max_nonfinite = 2: the second non-finite update in a row raises, one does not."""
    bad = {"finite": False, "loss": float("nan"), "grad_norm": float("nan")}
    state = {"streak": 0, "total": 0}
    replay_nonfinite([bad], state, 2, "p")
    with pytest.raises(NonFiniteUpdateError, match="2 non-finite updates in a row"):
        replay_nonfinite([bad], state, 2, "p")


def test_ratio_log_holds_the_clamped_log_ratio():
    """ratio_log records the log_s the loss used: clamp(lp_new - lp_old, -10, 10)."""
    pol = _Toy({1: -1.0, 2: -1.0})
    log: dict = {}
    _update(preset("hacpo", {"num_minibatches": 1}), pol, _view([1.0, 1.0], [True, False], [1, 2]),
            torch.tensor([-16.0, 13.0], dtype=F64), lr=0.0, ratio_log=log)
    assert float(torch.cat(log["self"])[0]) == 10.0
    assert float(torch.cat(log["cross"])[0]) == -10.0


def test_gspo2x_runs_twice_the_minibatches():
    """SPEC's gspo2x: half-size minibatches, i.e. 2M updates per step."""
    pol = _Toy({p: -1.0 for p in range(4)})
    trace: list = []
    _update(preset("gspo2x", {"num_minibatches": 2}), pol,
            _view([1.0, -1.0, 0.5, 0.0], [True] * 4, [0, 1, 2, 3]),
            torch.full((4,), -1.0, dtype=F64), lr=0.0, trace=trace)
    assert len(trace) == 4


# ---------------------------------------------------------------- pooled metrics, grad norm
def test_kl_metric_is_pooled_over_self_rows():
    """The step's kl is the mean over all self rows: updates weighted by their self rows."""
    pm = UpdateMetrics()
    pm.add({"kl": 1.0}, n_self=1, n_cross=5, n_tokens=10)
    pm.add({"kl": 4.0}, n_self=3, n_cross=0, n_tokens=10)
    assert pm.result()["kl"] == pytest.approx((1.0 + 3 * 4.0) / 4)


def test_low_precision_grad_norm_is_the_2_norm():
    """grad_norm_fp32 over bf16 gradients is the 2-norm of all of them as one vector."""
    grads = [torch.tensor([3.0, 0.0], dtype=torch.bfloat16), torch.tensor([4.0]).bfloat16()]
    assert float(grad_norm_fp32(grads)) == 5.0


def test_low_precision_clip_rounds_once():
    """step_clipped with a plain optimizer scales bf16 gradients by the fp32 clip coefficient
    with one rounding to bf16: each result is the bf16 value nearest to g * coef (the
    coefficient itself rounded to bf16 first is a second rounding, off by up to an ulp)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
    p.grad = (torch.randn(4096, generator=gen) * 3).bfloat16()
    g64 = p.grad.double()
    max_norm = float(g64.norm()) / 3.7
    coef = clip_coefficient(grad_norm_fp32([p.grad]), max_norm)     # fp32, pinned elsewhere
    step_clipped(torch.optim.SGD([p], lr=0.0), [p], max_norm=max_norm)
    exact = g64 * float(coef)
    # nearest bf16: |got - exact| <= half the spacing of bf16 at |exact|
    spacing = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    err = (p.grad.double() - exact).abs()
    assert bool((err <= spacing / 2 * (1 + 2 ** -16)).all()), float((err / spacing).max())
