"""Prompt states for Hugging Face policies (llama, qwen2, gpt2): prompts forwarded once into
their key/value cache, responses scored on it, give the log-probs and parameter gradients of
whole sequences, also through detached leaf states and one backward through the prompts; and
``update_learner``'s shared path gives the whole-sequence update."""
import pytest
import torch

from hacpo.engine import preset
from hacpo.engine.update import update_learner
from hacpo.models.policy import PolicyConfig, build_policy
from tests.engine._cases import learner_case

ARCHS = ["llama", "qwen2", "gpt2"]
QUESTIONS = ["What is 2+3?", "Tom has 12 apples and eats 5. How many are left?", "7*8=?"]


@pytest.fixture(scope="module", params=ARCHS)
def hf_policy(request):
    return build_policy(PolicyConfig(name=f"hf-{request.param}", kind="hf", arch=request.param,
                                     seed=1))


def _rows(policy, n=14, seed=1):
    """n rows over 3 prompts of different lengths: prompts 0 and 1 shared by several rows,
    prompt 2 by one; responses of 0..10 tokens, row 3 empty."""
    tok = policy.tokenizer
    prompts = [tok.prompt_ids(q) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) == 3
    g = torch.Generator().manual_seed(seed)
    P, R = [], []
    for i in range(n - 1):
        P.append(prompts[i % 2])
        L = int(torch.randint(0, 11, (1,), generator=g))
        R.append(torch.randint(4, tok.vocab_size, (L,), generator=g).tolist())
    R[3] = []
    R[0] = R[0][:1] or [5]
    P.append(prompts[2])
    R.append(torch.randint(4, tok.vocab_size, (7,), generator=g).tolist())
    uniq: dict[tuple, int] = {}
    of_row = [uniq.setdefault(tuple(p), len(uniq)) for p in P]
    w = torch.randn(n, 10, generator=g)
    return P, R, [list(k) for k in uniq], of_row, w


def _grads(policy):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            for p in policy.parameters()]


def _whole(policy, P, R, w, temperature=0.7):
    policy.share_prompts = False
    try:
        policy.zero_grad()
        lp, mask = policy.response_logprobs(P, R, temperature=temperature)
        (lp * w[:, :lp.shape[1]]).sum().backward()
    finally:
        policy.share_prompts = True
    return lp.detach(), mask, _grads(policy)


def _assert_same(lp, mask, grads, ref_lp, ref_mask, ref_grads):
    assert torch.equal(mask, ref_mask)
    assert torch.isfinite(lp).all()
    # fp32, the same math with the prompt's keys/values computed in a separate forward:
    # rounding only (a wrong position, mask or prompt assignment moves log-probs by O(0.1))
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    scale = max(g.abs().max() for g in ref_grads)
    assert scale > 1e-2                                   # the comparison is not vacuous
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5 * scale, rtol=1e-4)


def test_continuation_equals_whole_sequences(hf_policy):
    pol = hf_policy
    assert pol.supports_prompt_states
    P, R, uniq, of_row, w = _rows(pol)
    ref_lp, ref_mask, ref_grads = _whole(pol, P, R, w)
    assert ref_mask[3].sum() == 0 and ref_mask.shape[1] == max(len(r) for r in R)

    pol.zero_grad()
    states = pol.encode_prompts(uniq)
    kv0 = [t.detach().clone() for t in states.tensors()]
    k0 = states.kv[0][0]
    assert k0.shape[0] == 3 and k0.shape[2] == max(len(p) for p in uniq)
    assert states.last.shape == (3, pol.output_weight.shape[1])
    assert states.lengths.tolist() == [len(p) for p in uniq]
    lp, mask = pol.continuation_logprobs(states, of_row, R, temperature=0.7)
    (lp * w[:, :lp.shape[1]]).sum().backward()
    _assert_same(lp.detach(), mask, _grads(pol), ref_lp, ref_mask, ref_grads)
    # the states' tensors are read, never written (a fresh cache per call)
    assert all(torch.equal(a, b) for a, b in zip(kv0, states.tensors()))
    # one-token responses only (a single query per row) over the three prompts
    one = [[7], [8], [9]]
    with torch.no_grad():
        lp1, _ = pol.continuation_logprobs(states, [0, 1, 2], one)
        pol.share_prompts = False
        ref1, _ = pol.response_logprobs(uniq, one)
        pol.share_prompts = True
    torch.testing.assert_close(lp1, ref1, atol=1e-5, rtol=1e-5)


def test_detached_leaves_and_one_prompt_backward(hf_policy):
    """Responses scored in two calls on leaf states (like update_learner's self and cross
    parts), then one backward through the prompts: the whole-sequence gradient."""
    pol = hf_policy
    P, R, uniq, of_row, w = _rows(pol)
    ref_lp, ref_mask, ref_grads = _whole(pol, P, R, w)

    pol.zero_grad()
    states = pol.encode_prompts(uniq)
    leaves = states.detached()
    parts = [list(range(0, 14, 2)), list(range(1, 14, 2))]
    lp = torch.zeros_like(ref_lp)
    for rows in parts:
        lp_p, mask_p = pol.continuation_logprobs(leaves, [of_row[b] for b in rows],
                                                 [R[b] for b in rows], temperature=0.7)
        (lp_p * w[rows, :lp_p.shape[1]]).sum().backward()
        lp[rows, :lp_p.shape[1]] = lp_p.detach()
    responses_only = _grads(pol)
    assert all(t.grad is not None for t in leaves.tensors())
    assert states.backward_from(leaves)
    _assert_same(lp, ref_mask, _grads(pol), ref_lp, ref_mask, ref_grads)
    # the prompts' share of the gradient is real: without backward_from it is missing
    diff = max((a - b).abs().max() for a, b in zip(responses_only, ref_grads))
    assert diff > 1e-3


def test_response_logprobs_shares_prompts(hf_policy, monkeypatch):
    """Rows sharing a prompt in one response_logprobs call: prompts encoded once, same
    values and gradients as whole sequences; distinct prompts: whole sequences."""
    pol = hf_policy
    P, R, uniq, _, w = _rows(pol)
    ref_lp, ref_mask, ref_grads = _whole(pol, P, R, w)
    calls = []
    encode = type(pol).encode_prompts
    monkeypatch.setattr(type(pol), "encode_prompts",
                        lambda self, p: calls.append(len(p)) or encode(self, p))
    pol.zero_grad()
    lp, mask = pol.response_logprobs(P, R, temperature=0.7)
    (lp * w[:, :lp.shape[1]]).sum().backward()
    assert calls == [3]
    _assert_same(lp.detach(), mask, _grads(pol), ref_lp, ref_mask, ref_grads)
    pol.response_logprobs(uniq, R[:3])
    assert calls == [3]


def test_eager_attention_and_flash_refused():
    """The eager implementation (additive float masks) gives the same log-probs; a
    flash-attention model (unpads by the mask, no holes) has no prompt states."""
    pol = build_policy(PolicyConfig(name="e", kind="hf", arch="llama", seed=1))
    pol.model.config._attn_implementation = "eager"
    P, R, uniq, of_row, _ = _rows(pol)
    with torch.no_grad():
        lp, mask = pol.continuation_logprobs(pol.encode_prompts(uniq), of_row, R)
        pol.share_prompts = False
        ref, ref_mask = pol.response_logprobs(P, R)
    assert torch.equal(mask, ref_mask) and torch.isfinite(lp).all()
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
    pol.model.config._attn_implementation = "flash_attention_2"
    assert not pol.supports_prompt_states
    with pytest.raises(NotImplementedError, match="'e'.*flash_attention_2"):
        pol.encode_prompts(uniq)


def test_max_len_and_bad_input():
    pol = build_policy(PolicyConfig(name="short-gpt2", kind="hf", arch="gpt2", seed=1,
                                    hf_config={"n_positions": 24}))
    assert pol.max_len == 24
    tok = pol.tokenizer
    p = tok.prompt_ids("What is 2+3?")                     # 12+ tokens (char tokenizer)
    states = pol.encode_prompts([p, p[:3]])
    ok = [5] * (24 - len(p))
    lp, mask = pol.continuation_logprobs(states, [0, 1], [ok, ok + [5]])  # both fit
    assert torch.isfinite(lp).all() and mask.sum() == 2 * len(ok) + 1
    with pytest.raises(ValueError, match=r"'short-gpt2'.*25 tokens exceeds max_len=24"):
        pol.continuation_logprobs(states, [1, 0], [ok, ok + [5]])
    with pytest.raises(ValueError, match="'short-gpt2'.*exceeds max_len=24"):
        pol.encode_prompts([[5] * 25])
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        pol.encode_prompts([p, []])
    with pytest.raises(ValueError, match="prompt index out of range"):
        pol.continuation_logprobs(states, [2], [[5]])


def test_sliding_window_model_has_no_prompt_states():
    """qwen2 with sliding-window layers: the window counts cache slots, which prompt padding
    would shift; such a model says so and forwards whole sequences."""
    pol = build_policy(PolicyConfig(name="sw", kind="hf", arch="qwen2", seed=1, hf_config={
        "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}))
    assert not pol.supports_prompt_states
    with pytest.raises(NotImplementedError, match="'sw'.*sliding_attention"):
        pol.encode_prompts([[5, 6]])
    lp, mask = pol.response_logprobs([[5, 6], [5, 6]], [[7, 8], [9]])   # whole sequences
    assert mask.sum() == 3 and torch.isfinite(lp).all()


# -- update_learner: shared prompt states vs whole sequences --------------------------------------
def _learner_setup(arch):
    pol = build_policy(PolicyConfig(name=f"u-{arch}", kind="hf", arch=arch, seed=3))
    # 3 prompts of different lengths
    return (pol, *learner_case(pol, ((1, 2), (33, 4), (5, 666))))


def _update(pol, view, lp_old, p_of, micro_batch):
    opt = torch.optim.SGD(pol.parameters(), lr=0.5)
    m = update_learner(preset("hacpo", {"num_minibatches": 1}), pol, opt, view, lp_old=lp_old,
                       old_token_logp=[], prompt_of_sample=p_of,
                       generator=torch.Generator().manual_seed(0), micro_batch=micro_batch,
                       grad_clip=0.0, nonfinite={"streak": 0, "total": 0}, max_nonfinite=3)
    return m, torch.cat([p.detach().flatten() for p in pol.parameters()])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("micro_batch", [4, 64])
def test_update_learner_shared_equals_whole_sequences(arch, micro_batch):
    pol, view, lp_old, p_of = _learner_setup(arch)
    assert pol.supports_prompt_states and pol.share_prompts
    state = {k: v.clone() for k, v in pol.state_dict().items()}
    before = torch.cat([p.detach().flatten().clone() for p in pol.parameters()])
    m_shared, w_shared = _update(pol, view, lp_old, p_of, micro_batch)
    pol.load_state_dict(state)
    pol.share_prompts = False
    m_whole, w_whole = _update(pol, view, lp_old, p_of, micro_batch)
    assert (w_whole - before).abs().max() > 1e-3          # the step moved the weights
    # SGD lr=0.5 on fp32 gradients that agree to rounding
    torch.testing.assert_close(w_shared, w_whole, rtol=0, atol=2e-6)
    for k in ("loss", "grad_norm", "self_ratio_mean", "cross_ratio_mean"):
        assert m_shared[k] == pytest.approx(m_whole[k], abs=1e-6), k
    plen = sum(len(view.prompt_ids[j]) for j in (0, 5, 10))
    assert m_shared["tokens_forward_prompt"] == plen       # each prompt forwarded once
    assert m_whole["tokens_forward_prompt"] == 0
