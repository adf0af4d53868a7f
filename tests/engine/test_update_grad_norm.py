"""update_learner's grad norm and clip with bf16 / fp16 weights: the norm is taken and the clip
coefficient applied in fp32 (an fp16 norm above 65504 was inf: a finite update was skipped as
non-finite, and ``max_nonfinite`` of them stopped the run); fp32 weights clip exactly as
``torch.nn.utils.clip_grad_norm_``."""
import pytest
import torch

from hacpo.engine import preset
from hacpo.engine.pool import LearnerView
from hacpo.engine.update import adamw, update_learner


class Linear(torch.nn.Module):
    """Every row's log-prob is ``sum(w * c) - 1`` (``w`` starts at 0: ratios 1 against old
    log-probs of -1), so with the view below each weight's gradient is ``-0.625 * c``."""
    name = "lin"

    def __init__(self, c: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(c.numel(), dtype=dtype))
        self.c = c

    def response_logprobs(self, prompts, resps, temperature=1.0):
        T = max(len(r) for r in resps)
        lp = (self.w * self.c).sum() - 1.0
        return lp.expand(len(resps), T), torch.ones(len(resps), T, dtype=torch.bool)


def _update(pol, opt, clip, nonfinite, max_nonfinite=3):
    view = LearnerView(torch.arange(4), torch.tensor([1.0, -1.0, 2.0, 0.5]), torch.ones(4),
                       torch.ones(4, dtype=torch.bool), [[1], [1], [2], [2]], [[2, 3]] * 4, {})
    return update_learner(preset("gspo", {"num_minibatches": 1}), pol, opt, view,
                          lp_old=torch.full((4,), -1.0), old_token_logp=[],
                          prompt_of_sample=torch.tensor([0, 0, 1, 1]),
                          generator=torch.Generator().manual_seed(0), micro_batch=8,
                          grad_clip=clip, nonfinite=nonfinite, max_nonfinite=max_nonfinite)


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_float16_norm_above_fp16_max_is_finite_and_applied(clip):
    # 20000 gradients of 625 (finite in fp16) have norm 625 * sqrt(20000) = 88388 > 65504:
    # it was inf, the update skipped, and the third such update in a row stopped the run
    pol = Linear(torch.full((20000,), 1000.0), torch.float16)
    opt = adamw(pol.parameters(), lr=1e-3)
    state = {"streak": 0, "total": 0}
    norms = []
    for _ in range(3):
        m = _update(pol, opt, clip, state)
        assert "skipped_updates" not in m and state == {"streak": 0, "total": 0}, (m, state)
        norms.append(m["grad_norm"])
    # fp32's sum of 20000 squares is off by ~2e-5 (as with fp32 weights); fp16 would be inf
    assert norms[0] == pytest.approx(625 * 20000 ** 0.5, rel=1e-4)
    assert torch.isfinite(pol.w).all()
    assert (pol.w.detach().float() > 0).all(), pol.w        # the steps went up the gradient


def test_bfloat16_grad_norm_is_not_rounded_to_bfloat16():
    c = torch.rand(4096, generator=torch.Generator().manual_seed(0)) + 0.5
    pol = Linear(c, torch.bfloat16)
    m = _update(pol, adamw(pol.parameters(), lr=0.0), 0.0, {"streak": 0, "total": 0})
    # MasterWeightAdamW leaves the bf16 gradients as they were: the norm of their values
    expect = float(torch.linalg.vector_norm(pol.w.grad.double()))
    assert m["grad_norm"] == pytest.approx(expect, rel=1e-6)       # bf16 keeps ~3e-3


def test_master_weights_get_the_clip_coefficient_in_fp32():
    # gradients (25000, 25000, 25000, 1e-3): clip 1 scales them by 1/43301; the small one
    # becomes 2.3e-8, which rounds to 0 in fp16; the fp32 master gradient keeps it
    c = torch.tensor([4e4, 4e4, 4e4, 1.6e-3])
    pol = Linear(c, torch.float16)
    opt = adamw(pol.parameters(), lr=1e-3)
    m = _update(pol, opt, 1.0, {"streak": 0, "total": 0})
    g = pol.w.grad.float()                                   # fp16 gradients, not clipped
    norm = torch.linalg.vector_norm(g)
    assert m["grad_norm"] == pytest.approx(float(norm), rel=1e-6)
    master = opt._pairs[0][1]
    exp_avg = opt.state[master]["exp_avg"]                  # (1 - beta1) * clipped gradient
    torch.testing.assert_close(exp_avg, 0.1 * g / (norm + 1e-6), rtol=1e-6, atol=0)
    assert exp_avg[3] != 0


@pytest.mark.parametrize("clip", [0.0, 0.3, 1e6])
def test_fp32_clip_is_clip_grad_norm_bit_for_bit(clip):
    from hacpo.engine.update import step_clipped
    gen = torch.Generator().manual_seed(1)
    ps = [torch.nn.Parameter(torch.zeros(s)) for s in ((7, 3), (11,), (2, 2, 5))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(ps, qs):
        q.grad = p.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(ps, clip if clip > 0 else float("inf"))
    got = step_clipped(torch.optim.SGD(qs, lr=0.0), qs, clip)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    if clip == 0.3:
        assert float(want) > 1.0                            # the clip acted
    for p, q in zip(ps, qs):
        assert torch.equal(p.grad, q.grad)
