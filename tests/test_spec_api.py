"""SPEC.md "Public API", pinned from SPEC's text (not from the code): every name at its stated
import path; every parameter SPEC lists with its name, order, positional / keyword-only kind and
default (parameters SPEC does not list must have defaults, so SPEC's calls stay complete); the
return shapes and dtypes; and the errors SPEC prescribes (reward outside [0, 1] or NaN naming
prompt and agent, a row with no token, backend="triton" on CPU without TRITON_INTERPRET).
The math itself is re-derived in tests/engine/test_spec_independent.py; the values checked here
are the few that pin a documented semantic (loss = -mean(obj), token-mean GRPO, packed means).
Tiny CPU inputs only.
"""
import inspect
import math

import pytest
import torch

import hacpo.engine
import hacpo.kernels

P, K = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
REQ = inspect.Parameter.empty
ANY = object()        # SPEC gives a default without its value (fused_linear's chunk_size=...)

# name -> [(parameter, kind, default)], in SPEC's order, copied from SPEC.md's code block
SPEC_SIGNATURES = {
    ("hacpo.engine", "CapabilityTracker"): [
        ("num_agents", P, REQ), ("window", P, 5), ("metric", P, "positive_rate"),
        ("minimum", P, 1e-8), ("ratio_min", P, 0.1), ("ratio_max", P, 10.0)],
    ("hacpo.engine", "hacpo_advantages"): [
        ("rewards", P, REQ), ("prompt", P, REQ), ("agent", P, REQ), ("learner", K, REQ),
        ("ratios", K, REQ), ("eps", K, 1e-6), ("uniform_guard", K, True),
        ("binary_guard", K, True), ("cross_baseline", K, "learner")],
    ("hacpo.engine", "group_advantages"): [
        ("rewards", P, REQ), ("prompt", P, REQ), ("eps", K, 1e-6)],
    ("hacpo.engine", "sequence_mean_logprob"): [("token_logp", P, REQ), ("mask", P, REQ)],
    ("hacpo.engine", "hacpo_policy_loss"): [
        ("new_lp", P, REQ), ("old_lp", P, REQ), ("advantages", P, REQ), ("is_self", P, REQ),
        ("omega", P, REQ), ("minibatch_index", K, REQ), ("alpha", K, 1.0),
        ("cross_clip", K, "stepwise"), ("cross_clip_delta", K, 0.2),
        ("cross_clip_step", K, 0.025), ("self_clip_low", K, 3e-4), ("self_clip_high", K, 4e-4),
        ("max_abs_log_ratio", K, 10.0)],
    ("hacpo.engine", "gspo_policy_loss"): [
        ("new_lp", P, REQ), ("old_lp", P, REQ), ("advantages", P, REQ), ("clip_low", K, 3e-4),
        ("clip_high", K, 4e-4), ("max_abs_log_ratio", K, 10.0)],
    ("hacpo.engine", "grpo_policy_loss"): [
        ("token_logp", P, REQ), ("old_token_logp", P, REQ), ("mask", P, REQ),
        ("advantages", P, REQ), ("clip_low", K, 0.2), ("clip_high", K, 0.28)],
    ("hacpo.kernels", "token_logprobs"): [
        ("logits", P, REQ), ("targets", P, REQ), ("temperature", K, 1.0), ("backend", K, "auto"),
        ("tp_group", K, None)],
    ("hacpo.kernels", "sequence_mean_logprobs"): [
        ("logits", P, REQ), ("targets", P, REQ), ("cu_seqlens", P, REQ), ("temperature", K, 1.0),
        ("backend", K, "auto"), ("tp_group", K, None)],
    ("hacpo.kernels", "fused_linear_token_logprobs"): [
        ("hidden", P, REQ), ("weight", P, REQ), ("targets", P, REQ), ("temperature", K, 1.0),
        ("chunk_size", K, ANY), ("backend", K, "auto"), ("tp_group", K, None)],
}


@pytest.mark.parametrize("where", sorted(SPEC_SIGNATURES), ids=lambda w: f"{w[0]}.{w[1]}")
def test_signature_matches_spec(where):
    module, name = where
    obj = getattr({"hacpo.engine": hacpo.engine, "hacpo.kernels": hacpo.kernels}[module], name)
    params = inspect.signature(obj).parameters
    spec = SPEC_SIGNATURES[where]
    for pname, kind, default in spec:
        assert pname in params, f"{name} lacks SPEC's parameter {pname!r}"
        p = params[pname]
        assert p.kind is kind, f"{name}({pname}) is {p.kind}, SPEC says {kind}"
        if default is ANY:
            assert p.default is not REQ, f"{name}({pname}) needs a default"
        else:
            assert p.default == default and type(p.default) is type(default), \
                f"{name}({pname}) default {p.default!r}, SPEC says {default!r}"
    positional = [k for k, p in params.items() if p.kind in (p.POSITIONAL_ONLY, P)]
    assert positional[:len([s for s in spec if s[1] is P])] == [s[0] for s in spec if s[1] is P]
    # no extra required positional parameters (SPEC's positional calls stay complete)
    extra_pos = positional[len([s for s in spec if s[1] is P]):]
    assert all(params[k].default is not REQ for k in extra_pos), (name, extra_pos)
    spec_kw = [s[0] for s in spec if s[1] is K]
    kw_in_order = [k for k in params if k in spec_kw]
    assert kw_in_order == spec_kw, f"{name} keyword order {kw_in_order}, SPEC {spec_kw}"
    listed = {s[0] for s in spec}
    extras = [k for k, p in params.items() if k not in listed and k != "self"
              and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    assert all(params[k].default is not REQ for k in extras), \
        f"{name}: parameters SPEC does not list must have defaults: {extras}"


def test_tracker_method_signatures():
    from hacpo.engine import CapabilityTracker
    sig = {m: list(inspect.signature(getattr(CapabilityTracker, m)).parameters)
           for m in ("update", "ratios", "state_dict", "load_state_dict")}
    assert sig == {"update": ["self", "rewards", "agent"], "ratios": ["self"],
                   "state_dict": ["self"], "load_state_dict": ["self", "sd"]}


def test_names_in_dunder_all():
    engine = {"CapabilityTracker", "hacpo_advantages", "group_advantages",
              "sequence_mean_logprob", "hacpo_policy_loss", "gspo_policy_loss", "grpo_policy_loss"}
    assert engine <= set(hacpo.engine.__all__)
    assert {"token_logprobs", "sequence_mean_logprobs",
            "fused_linear_token_logprobs"} <= set(hacpo.kernels.__all__)


def test_misspelt_kernels_name_is_a_clear_error():
    """hacpo.kernels loads two names lazily (module __getattr__); any other name must fail as a
    module attribute does, naming the module and the attribute (was a bare AttributeError('x'))."""
    with pytest.raises(AttributeError,
                       match=r"^module 'hacpo.kernels' has no attribute 'token_logprob'$"):
        hacpo.kernels.token_logprob  # noqa: B018


# ---------------------------------------------------------------------------------------------
# CapabilityTracker
# ---------------------------------------------------------------------------------------------
def test_tracker_update_ratios_state_dict():
    from hacpo.engine import CapabilityTracker
    t = CapabilityTracker(3, 5, "positive_rate", 1e-8, 0.1, 10.0)      # SPEC's positional order
    assert torch.equal(t.ratios().float(), torch.ones(3, 3))           # before the first update
    agent = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    rewards = torch.tensor([1., 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0])
    phat = t.update(rewards, agent)
    assert phat.shape == (3,)
    assert torch.allclose(phat.double(), torch.tensor([0.75, 0.25, 1e-8], dtype=torch.float64))
    r = t.ratios()
    assert r.shape == (3, 3)
    expect = (phat.double()[:, None] / phat.double()[None, :]).clamp(0.1, 10.0)
    assert torch.allclose(r.double(), expect)          # ratios[s, t] = clamp(Phat_s / Phat_t)
    assert r[0, 1] == 3.0 and r[0, 2] == 10.0 and r[2, 0] == 0.1
    t2 = CapabilityTracker(3)
    t2.load_state_dict(t.state_dict())
    assert torch.equal(t2.ratios(), r)


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan")])
def test_tracker_rejects_reward_outside_unit_interval_naming_agent(bad):
    from hacpo.engine import CapabilityTracker
    t = CapabilityTracker(2)
    with pytest.raises(ValueError, match=r"agent 1"):
        t.update(torch.tensor([1.0, 0.0, 0.0, bad]), torch.tensor([0, 0, 1, 1]))


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------
def _pool():
    rewards = torch.tensor([1., 0, 1, 1, 0, 0, 1, 1, 1, 1])
    prompt = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    agent = torch.tensor([0, 1, 1, 0, 1, 1, 0, 0, 1, 1])
    return rewards, prompt, agent


def test_hacpo_advantages_shape_and_formula():
    from hacpo.engine import hacpo_advantages
    rewards, prompt, agent = _pool()
    omega = torch.tensor([[1.0, 2.0], [0.5, 1.0]])                   # omega[s, t]
    A = hacpo_advantages(rewards, prompt, agent, learner=0, ratios=omega)
    assert A.shape == (10,) and A.dtype == rewards.dtype
    # group 0: w = 1/omega[s_i, 0] = (1, 2, 2); mu = (1 + 0 + 2) / 3 = 1 (binary guard needs > 1)
    sd0 = torch.tensor([1., 0, 1]).std() + 1e-6
    assert torch.allclose(A[:3], (torch.tensor([1., 0, 1]) - 1.0) / sd0)
    # group 1: mu = (1 * 1) / 3
    sd1 = torch.tensor([1., 0, 0]).std() + 1e-6
    assert torch.allclose(A[3:6], (torch.tensor([1., 0, 0]) - 1 / 3) / sd1)
    assert torch.equal(A[6:], torch.zeros(4))                        # uniform group
    with pytest.raises(TypeError):                                   # learner, ratios: keyword-only
        hacpo_advantages(rewards, prompt, agent, 0, omega)


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan")])
def test_hacpo_advantages_bad_reward_names_prompt_and_agent(bad):
    from hacpo.engine import hacpo_advantages
    rewards, prompt, agent = _pool()
    rewards[4] = bad                                                 # prompt 1, agent 1
    with pytest.raises(ValueError, match=r"prompt 1.*agent 1"):
        hacpo_advantages(rewards, prompt, agent, learner=0, ratios=torch.ones(2, 2))


def test_group_advantages_plain_mean_std():
    from hacpo.engine import group_advantages
    rewards, prompt, _ = _pool()
    A = group_advantages(rewards, prompt)
    assert A.shape == (10,)
    for g in range(3):
        r = rewards[prompt == g]
        assert torch.allclose(A[prompt == g], (r - r.mean()) / (r.std() + 1e-6))
    rewards[0] = float("nan")
    with pytest.raises(ValueError, match=r"prompt 0"):
        group_advantages(rewards, prompt)


def test_sequence_mean_logprob_shape_and_empty_row():
    from hacpo.engine import sequence_mean_logprob
    lp = torch.tensor([[-1., -2., -3.], [-4., -5., -6.]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    assert torch.equal(sequence_mean_logprob(lp, mask), torch.tensor([-1.5, -5.0]))
    mask[1] = False
    with pytest.raises(ValueError, match=r"\b1\b"):                  # names the empty row
        sequence_mean_logprob(lp, mask)


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------
def test_hacpo_policy_loss_is_minus_mean_obj_and_reports_spec_metrics():
    from hacpo.engine import hacpo_policy_loss
    lo = 1 - 0.2                                          # stepwise bound at m = 0
    s_self = [1.0, 1.0, math.exp(0.01), math.exp(-0.01)]  # last two outside [1-3e-4, 1+4e-4]
    s_cross = [0.5, 0.7, 0.9, 1.2, 0.95]                  # 2 below lo, 1 above 1
    s = torch.tensor(s_self + s_cross, dtype=torch.float64)
    new_lp = s.log().requires_grad_()
    old_lp = torch.zeros(9, dtype=torch.float64)
    A = torch.tensor([1., -1, 2, -2, 1, -1, 0.5, 2, -0.5], dtype=torch.float64)
    is_self = torch.tensor([True] * 4 + [False] * 5)
    omega = torch.tensor([1.] * 4 + [2., 0.5, 3., 1., 4.], dtype=torch.float64)
    loss, metrics = hacpo_policy_loss(new_lp, old_lp, A, is_self, omega, minibatch_index=0)
    assert loss.dim() == 0
    obj = []
    for i in range(9):
        si, a = float(s[i]), float(A[i])
        if is_self[i]:
            obj.append(min(si * a, min(max(si, 1 - 3e-4), 1 + 4e-4) * a))
        else:
            c = min(max(si, lo), 1.0)
            obj.append(c * c * float(omega[i]) * a)       # c * sg(c)^alpha, alpha = 1
    assert loss.item() == pytest.approx(-sum(obj) / 9, rel=1e-12)
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in metrics.values())
    values = [float(v) for v in metrics.values() if v.dim() == 0]
    expected = {"mean self ratio": sum(s_self) / 4, "mean cross ratio": sum(s_cross) / 5,
                "cross clipped below": 2 / 5, "cross clipped above": 1 / 5,
                "self clipped": 2 / 4}
    for what, want in expected.items():
        assert any(abs(v - want) < 1e-9 for v in values), f"no metric gives the {what} ({want})"


def test_gspo_policy_loss_default_clip_sequence_mean():
    from hacpo.engine import gspo_policy_loss
    s = torch.tensor([1.0, 1.1, 0.9, 1.0002], dtype=torch.float64)
    A = torch.tensor([1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    loss, metrics = gspo_policy_loss(s.log(), torch.zeros(4, dtype=torch.float64), A)
    clip = s.clamp(1 - 3e-4, 1 + 4e-4)
    assert loss.item() == pytest.approx(-torch.minimum(s * A, clip * A).mean().item(), rel=1e-12)
    assert loss.dim() == 0 and all(isinstance(v, torch.Tensor) for v in metrics.values())


def test_grpo_policy_loss_token_mean_over_mask():
    from hacpo.engine import grpo_policy_loss
    lp = torch.zeros(2, 3)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    A = torch.tensor([4.0, 1.0])
    loss, metrics = grpo_policy_loss(lp, lp, mask, A)        # ratio 1: obj = A per token
    assert loss.item() == pytest.approx(-(4.0 + 3 * 1.0) / 4)  # token-mean, not sequence-mean
    assert all(isinstance(v, torch.Tensor) for v in metrics.values())


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
def _logits(T=7, V=11, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(T, V, generator=g).to(dtype), torch.randint(0, V, (T,), generator=g)


def _truth(logits, targets, temperature=1.0):
    return torch.log_softmax(logits.double() / temperature, -1).gather(
        -1, targets[:, None]).squeeze(-1)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_contract(backend, dtype):
    from hacpo.kernels import token_logprobs
    x, t = _logits(dtype=dtype)
    x.requires_grad_()
    lp = token_logprobs(x, t, temperature=0.7, backend=backend, tp_group=None)
    assert lp.shape == (7,) and lp.dtype == torch.float32
    # float32 output of bf16 logits: the exact log-softmax of the bf16 values, to fp32 rounding
    assert torch.allclose(lp.double(), _truth(x.detach(), t, 0.7), atol=1e-5, rtol=0)
    g, = torch.autograd.grad(lp.sum(), x)
    assert g.shape == x.shape and g.dtype == dtype
    with pytest.raises(TypeError):                     # temperature is keyword-only
        token_logprobs(x, t, 0.7)


def test_sequence_mean_logprobs_packed():
    from hacpo.kernels import sequence_mean_logprobs
    x, t = _logits(T=7)
    cu = torch.tensor([0, 1, 4, 7])
    out = sequence_mean_logprobs(x, t, cu, temperature=1.3, backend="torch", tp_group=None)
    assert out.shape == (3,) and out.dtype == torch.float32
    tok = _truth(x, t, 1.3)
    want = torch.stack([tok[0:1].mean(), tok[1:4].mean(), tok[4:7].mean()])
    assert torch.allclose(out.double(), want, atol=1e-6, rtol=0)
    for bad in ([0, 1, 1, 7], [0, 1, 4, 6]):           # an empty sequence; does not end at T
        with pytest.raises(ValueError, match="cu_seqlens|sequence"):
            sequence_mean_logprobs(x, t, torch.tensor(bad))


def test_fused_linear_token_logprobs_contract():
    from hacpo.kernels import fused_linear_token_logprobs
    g = torch.Generator().manual_seed(1)
    h = torch.randn(6, 5, generator=g, requires_grad=True)
    w = torch.randn(9, 5, generator=g, requires_grad=True)
    t = torch.randint(0, 9, (6,), generator=g)
    lp = fused_linear_token_logprobs(h, w, t, temperature=0.8, chunk_size=4, backend="torch",
                                     tp_group=None)
    assert lp.shape == (6,) and lp.dtype == torch.float32
    assert torch.allclose(lp.double(), _truth((h @ w.t()).detach(), t, 0.8), atol=1e-5, rtol=0)
    gh, gw = torch.autograd.grad(lp.sum(), (h, w))
    assert gh.shape == h.shape and gw.shape == w.shape


def test_unknown_backend_is_an_error():
    from hacpo.kernels import token_logprobs
    x, t = _logits()
    with pytest.raises(ValueError, match="backend"):
        token_logprobs(x, t, backend="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error path")
@pytest.mark.parametrize("fn", ["token_logprobs", "sequence_mean_logprobs",
                                "fused_linear_token_logprobs"])
def test_triton_on_cpu_without_interpreter_is_a_clear_error(fn, monkeypatch):
    """SPEC: backend="triton" runs on CPU only under TRITON_INTERPRET=1; otherwise a clear
    error, never a silent switch to torch."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, t = _logits()
    call = {"token_logprobs": lambda f: f(x, t, backend="triton"),
            "sequence_mean_logprobs": lambda f: f(x, t, torch.tensor([0, 7]), backend="triton"),
            "fused_linear_token_logprobs":
                lambda f: f(torch.randn(7, 4), torch.randn(11, 4), t, backend="triton")}[fn]
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        call(getattr(hacpo.kernels, fn))
