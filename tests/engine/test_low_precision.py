"""bfloat16 / float16 policies on the plain-torch path: the optimizer steps fp32 master weights
(``hacpo.engine.update.MasterWeightAdamW``), so float16 weights stay finite and small bfloat16
updates accumulate instead of rounding away."""
import copy

import pytest
import torch

from hacpo.engine.update import MasterWeightAdamW, adamw
from hacpo.engine.warmup import supervised_warmup
from hacpo.models.policy import PolicyConfig, build_policy


def _policy(dtype: str):
    return build_policy(PolicyConfig(name="a", kind="decoder", tokenizer="char", d_model=32,
                                     n_layers=1, n_heads=2, max_len=64, dtype=dtype, seed=1))


def test_adamw_picks_master_weights_for_low_precision_only():
    assert type(adamw([torch.nn.Parameter(torch.ones(2))], lr=1e-3)) is torch.optim.AdamW
    for dt in (torch.float16, torch.bfloat16):
        assert isinstance(adamw([torch.nn.Parameter(torch.ones(2, dtype=dt))], lr=1e-3),
                          MasterWeightAdamW)


def test_float16_zero_and_tiny_gradients_stay_finite():
    # torch's AdamW on fp16 weights: eps=1e-8 and g^2 of |g| < ~1e-4 underflow to 0, so a
    # zero gradient gave NaN and a tiny one -inf
    p = torch.nn.Parameter(torch.tensor([1.0, 1.0, 1.0], dtype=torch.float16))
    opt = adamw([p], lr=1e-3)
    p.grad = torch.tensor([0.0, 1e-5, 1.0], dtype=torch.float16)
    opt.step()
    assert p.dtype == torch.float16
    assert torch.isfinite(p).all(), p
    assert p[0] == 1.0                            # no gradient, no decay: unchanged
    # Adam's first step is ~lr * sign(g) (eps is negligible next to 1e-5 in fp32)
    expect = torch.tensor([1.0, 1.0 - 1e-3, 1.0 - 1e-3]).to(torch.float16)
    torch.testing.assert_close(p.detach(), expect, atol=0, rtol=0)


def test_bfloat16_small_updates_accumulate():
    # lr 1e-3 on a weight of 1.0 (bf16 spacing 2^-8 below 1): each step alone rounds back to
    # 1.0; ten of them move the weight by ~1e-2, as in fp32
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    ref = torch.nn.Parameter(torch.ones(4))
    opt, ref_opt = adamw([p], lr=1e-3), torch.optim.AdamW([ref], lr=1e-3)
    for _ in range(10):
        for q, o in ((p, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=True)
            q.grad = torch.ones_like(q)
            o.step()
    assert p.dtype == torch.bfloat16
    assert float(ref.detach()[0]) < 0.9905               # fp32 moved ~1e-2 (weight decay 1e-2 too)
    torch.testing.assert_close(p.detach(), ref.detach().to(torch.bfloat16), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_warmup_in_low_precision_trains(dtype):
    # fp16 warm-up made every weight NaN in its first step ("non-finite log-prob at row 0"
    # in the next forward)
    pol = _policy(dtype)
    before = {k: v.detach().clone() for k, v in pol.named_parameters()}
    prompts, targets = [[5, 6, 7], [5, 6, 8]], [[8, 9, 10], [9, 9]]
    losses = supervised_warmup(pol, prompts, targets, steps=3, lr=3e-3, batch_size=4, seed=0)
    assert all(map(torch.isfinite, map(torch.tensor, losses))), losses
    assert losses[-1] < losses[0], losses
    for k, v in pol.named_parameters():
        assert v.dtype == getattr(torch, dtype), k
        assert torch.isfinite(v).all(), k
        assert (v != before[k]).any(), f"{k} did not move"
    tl, mask = pol.response_logprobs(prompts, targets)
    assert torch.isfinite(tl[mask]).all()


def test_master_weights_follow_weights_written_elsewhere_and_checkpoint():
    pol = _policy("bfloat16")
    opt = adamw(pol.parameters(), lr=1e-3)
    w = pol.model.norm.weight
    w.grad = torch.ones_like(w)
    opt.step()
    # a load_state_dict / weight sync writes the weight: the next step starts from it
    with torch.no_grad():
        w.fill_(2.0)
    w.grad = torch.zeros_like(w)
    opt.step()
    assert float(w.float().min()) > 1.98 and float(w.float().max()) <= 2.0, w
    # the state dict holds the masters; a fresh optimizer loaded from it continues the same
    for _ in range(3):
        w.grad = torch.ones_like(w)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())     # as a checkpoint file holds it (no shared tensors)
    assert len(sd["master_weights"]) == len(list(pol.parameters()))
    pol2 = _policy("bfloat16")
    pol2.load_state_dict(pol.state_dict())
    opt2 = adamw(pol2.parameters(), lr=1e-3)
    opt2.load_state_dict(sd)
    w2 = pol2.model.norm.weight
    for o, q in ((opt, w), (opt2, w2)):
        q.grad = torch.ones_like(q)
        o.step()
    torch.testing.assert_close(w2.detach(), w.detach(), atol=0, rtol=0)
    torch.testing.assert_close(opt2._pairs[-1][1], opt._pairs[-1][1], atol=0, rtol=0)
    bad = dict(sd, master_weights=sd["master_weights"][:-1])
    with pytest.raises(ValueError, match="master weights"):
        adamw(_policy("bfloat16").parameters(), lr=1e-3).load_state_dict(bad)


def test_plain_adamw_state_loads_with_masters_from_the_weights():
    # a checkpoint of torch's AdamW (no "master_weights"): the masters are the loaded weights
    pol = _policy("bfloat16")
    plain = torch.optim.AdamW(pol.parameters(), lr=1e-3)
    for p in pol.parameters():
        p.grad = torch.ones_like(p)
    plain.step()
    opt = adamw(pol.parameters(), lr=1e-3)
    with torch.no_grad():
        for _, m in opt._pairs:
            m.zero_()
    opt.load_state_dict(copy.deepcopy(plain.state_dict()))
    for p, m in opt._pairs:
        assert m.dtype == torch.float32
        torch.testing.assert_close(m, p.detach().float(), atol=0, rtol=0)


def test_local_agents_step_low_precision_policies_with_master_weights():
    from hacpo.engine.agents import LocalAgents
    from hacpo.engine.run_config import load_config

    cfg = load_config("tiny3", overrides={"agents.0.policy.dtype": "float16"})
    agents = LocalAgents(cfg, [_policy("float16"), _policy("float32")])
    assert isinstance(agents.optims[0], MasterWeightAdamW)
    assert type(agents.optims[1]) is torch.optim.AdamW
    assert agents.optims[0].defaults["lr"] == cfg.agents[0].optim.lr
    assert agents.optims[0].defaults["betas"] == (cfg.agents[0].optim.beta1,
                                                  cfg.agents[0].optim.beta2)


class _ScaledSum(torch.nn.Module):
    """A stand-in policy: every target token's log-prob is ``scale * sum(w)``, so each
    element of w gets the gradient -scale (w: 20,000 float16 zeros)."""
    name = "scaled"

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale
        self.w = torch.nn.Parameter(torch.zeros(20_000, dtype=torch.float16))

    def response_logprobs(self, prompts, targets):
        T = max(map(len, targets))
        mask = torch.tensor([[j < len(t) for j in range(T)] for t in targets])
        return (self.w.float().sum() * self.scale).expand(len(targets), T), mask


def test_warmup_float16_grad_norm_above_fp16_max_steps():
    # gradient 625 per element: finite in fp16, but the norm 625 * sqrt(20000) = 88,388 is
    # above fp16's 65,504 (an fp16 norm was inf, the clip coefficient 0, and no weight moved)
    pol = _ScaledSum(625.0)
    supervised_warmup(pol, [[1]] * 4, [[2, 3]] * 4, steps=1, lr=1e-2, batch_size=4, seed=0)
    assert torch.isfinite(pol.w).all()
    assert (pol.w != 0).all(), pol.w


def test_warmup_nonfinite_gradient_is_an_error_and_takes_no_step():
    pol = _ScaledSum(float("inf"))
    with pytest.raises(RuntimeError, match=r"warm-up of policy 'scaled', step 0: non-finite "
                                           r"gradient norm"):
        supervised_warmup(pol, [[1]] * 4, [[2, 3]] * 4, steps=2, lr=1e-2, batch_size=4, seed=0)
    assert (pol.w == 0).all()
