"""The CPU fast paths of the plain decoder and the policy give the same bits as the plain code
they replaced (torch.equal on values and gradients, same seeds), which is kept here as the
reference:

- ``qkv_rope`` (decoder.py): q/k/v split + rotary embedding as one autograd Function, vs
  splitting the qkv projection and ``apply_rope`` under autograd;
- ``prefix_cat`` (each continuation row's prompt keys/values and its own, with a dense
  gradient sum), vs ``cat([kp.index_select(0, prefix_of_row), kr])``;
- ``KVCache.repeat_interleave`` (the sampler's prompt -> G samples copy of the cache), vs
  ``KVCache.reorder`` of the whole buffers;
- ``Policy.continuation_logprobs``' vectorized index building, vs its per-row Python loop.

Bit-identity matters: a run's rollouts, losses and weights must not change with these."""
import contextlib

import pytest
import torch

from hacpo.models import generation
from hacpo.models.decoder import (Attention, Block, Decoder, DecoderConfig, KVCache,
                                  apply_rope, prefix_cat, qkv_rope, rope_cos_sin)
from hacpo.models.generation import generate
from hacpo.models.policy import Policy, PolicyConfig, build_policy


# -- the reference code (as it was before the fast paths) ------------------------------------
def _ref_project(self, x, cos, sin):
    B, L, _ = x.shape
    q, k, v = self.qkv(x).view(B, L, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _ref_forward_continued(self, xr, rope_r, mask_r, kp, vp, prefix_of_row, plan=None):
    qr, kr, vr = self.attn.project(self.attn_norm(xr), *rope_r)
    k = torch.cat([kp.index_select(0, prefix_of_row), kr], dim=2)
    v = torch.cat([vp.index_select(0, prefix_of_row), vr], dim=2)
    xr = xr + self.attn.attend(qr, k, v, mask_r)
    return xr + self.mlp(self.mlp_norm(xr))


def _ref_repeat(self, index):
    self.cache.reorder(index)


def _ref_continuation_logprobs(self, states, prompt_of_row, response_ids, *, temperature=1.0):
    dev = self.output_weight.device
    P, B = states.last.shape[0], len(response_ids)
    if B and not all(0 <= int(i) < P for i in prompt_of_row):
        raise ValueError(f"continuation_logprobs: prompt index out of range [0, {P})")
    Tmax = max((len(r) for r in response_ids), default=0)
    mask = torch.zeros(B, Tmax, dtype=torch.bool)
    if Tmax == 0:
        return torch.zeros(B, 0, device=dev), mask.to(dev)
    r_ids = torch.full((B, Tmax), self.tokenizer.pad_id, dtype=torch.long)
    src, targets = [], []
    for b, r in enumerate(response_ids):
        if r:
            r_ids[b, :len(r)] = torch.tensor(list(r), dtype=torch.long)
            mask[b, :len(r)] = True
            src.append(int(prompt_of_row[b]))
            src += [P + b * Tmax + j for j in range(len(r) - 1)]
            targets += r
    self._check_ids(r_ids[mask], "response")
    pidx = torch.tensor([int(i) for i in prompt_of_row], dtype=torch.long, device=dev)
    hr = self.model.hidden_continued(states, r_ids.to(dev), mask.to(dev), pidx)
    h = torch.cat([states.last, hr.reshape(B * Tmax, hr.shape[-1])])
    h = h.index_select(0, torch.tensor(src, dtype=torch.long, device=dev))
    return self._scatter_logprobs(h, targets, mask.to(dev), temperature)


REFERENCE = ((Attention, "project", _ref_project),
             (Block, "forward_continued", _ref_forward_continued),
             (generation._DecoderStepper, "repeat", _ref_repeat),
             (Policy, "continuation_logprobs", _ref_continuation_logprobs))


@contextlib.contextmanager
def reference_code():
    """The decoder, the sampler and the policy run the reference code inside (also used by
    benchmarks/bench_decoder_fast_paths.py)."""
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in REFERENCE]
    try:
        for owner, name, fn in REFERENCE:
            setattr(owner, name, fn)
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


@pytest.fixture
def reference():
    """Call ``reference()`` to switch to the reference code for the rest of the test."""
    with contextlib.ExitStack() as stack:
        yield lambda: stack.enter_context(reference_code())


def _layout(t):
    """The strides that matter (those of dims longer than 1)."""
    return tuple(s for s, n in zip(t.stride(), t.shape) if n > 1)


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- qkv_rope ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,L,H,Dh", [(3, 7, 4, 16), (1, 1, 2, 2), (5, 33, 4, 32)])
def test_qkv_rope_equals_split_and_apply_rope(B, L, H, Dh, dtype):
    g = torch.Generator().manual_seed(B * 100 + L)
    y0 = torch.randn(B, L, 3 * H * Dh, generator=g).to(dtype) * 3
    pos = torch.arange(L)[None] + torch.randint(0, 100, (B, 1), generator=g)
    cos, sin = rope_cos_sin(pos, Dh, 10000.0, dtype)
    ups = [torch.randn(B, H, L, Dh, generator=g).to(dtype) for _ in range(3)]

    def run(fn, used):
        y = y0.clone().requires_grad_()
        outs = fn(y)
        sum(((o.float() * u.float()).sum() for o, u, keep in zip(outs, ups, used) if keep),
            torch.zeros(())).backward()
        return [o.detach() for o in outs] + [y.grad]

    def ref(y):
        q, k, v = y.view(B, L, 3, H, Dh).permute(2, 0, 3, 1, 4)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    for used in ((True, True, True), (True, False, True), (False, True, False)):
        want, got = run(ref, used), run(lambda y: qkv_rope(y, cos, sin, H, Dh), used)
        assert _equal(want, got), used
        assert [_layout(t) for t in want[:3]] == [_layout(t) for t in got[:3]]
    with torch.inference_mode():                        # the sampler's decode steps
        assert _equal(ref(y0), qkv_rope(y0, cos, sin, H, Dh))


# -- the decoder's three paths and the sampler --------------------------------------------------
def _decoder(seed, d_model, n_layers):
    torch.manual_seed(seed)
    m = Decoder(DecoderConfig(vocab_size=37, d_model=d_model, n_layers=n_layers, n_heads=4,
                              max_len=96))
    with torch.no_grad():       # larger weights than the init's: rounding differences show up
        for p in m.parameters():
            p.mul_(20)
    return m


def _decoder_results(m):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 37, (6, 20), generator=g)
    attn = torch.arange(20)[None] < torch.tensor([20, 3, 11, 20, 1, 7])[:, None]
    P, Lp, N, Lr = 3, 9, 8, 12
    p_ids = torch.randint(0, 37, (P, Lp), generator=g)
    p_mask = torch.arange(Lp)[None] < torch.tensor([9, 2, 5])[:, None]
    r_ids = torch.randint(0, 37, (N, Lr), generator=g)
    r_mask = torch.arange(Lr)[None] < torch.tensor([12, 1, 4, 12, 7, 3, 9, 12])[:, None]
    pref = torch.tensor([0, 0, 2, 1, 2, 2, 0, 1])
    up_h, up_c = torch.randn(6, 20, m.cfg.d_model, generator=g), torch.randn(
        N, Lr, m.cfg.d_model, generator=g)
    m.zero_grad(set_to_none=True)
    h = m.hidden(ids, attn)
    last, hc = m.hidden_prefixed(p_ids, p_mask, r_ids, r_mask, pref)
    ((h * up_h).sum() + (hc * up_c).sum() + last.sum()).backward()
    out = [h.detach(), last.detach(), hc.detach()] + [p.grad for p in m.parameters()]
    # detached prompt states, as the update uses them: continuation backward, then the prompts'
    m.zero_grad(set_to_none=True)
    states = m.encode_prefix(p_ids, p_mask)
    leaves = states.detached()
    (m.hidden_continued(leaves, r_ids, r_mask, pref) * up_c).sum().backward()
    assert states.backward_from(leaves)
    out += [p.grad for p in m.parameters()]
    return out


def _policy(seed, d_model, n_layers, tokenizer="char"):
    return build_policy(PolicyConfig(name="p", kind="decoder", tokenizer=tokenizer,
                                     d_model=d_model, n_layers=n_layers, n_heads=4,
                                     max_len=128, seed=seed))


def _rollout_results(pol, temperature, top_p):
    tok = pol.tokenizer
    prompts = [tok.prompt_ids(q) for q in ("What is 2+3?", "Tom has 12 apples and eats 5.",
                                           "7*8=?")]
    gen = torch.Generator().manual_seed(3)
    ro = generate(pol, prompts, num_samples=4, max_new_tokens=24, temperature=temperature,
                  top_p=top_p, generator=gen)
    return ro.response_ids, ro.sampler_logprobs, ro.finished_eos


@pytest.mark.parametrize("d_model,n_layers", [(64, 2), (128, 3)])
def test_decoder_forward_backward_and_sampling_equal_reference(reference, d_model, n_layers):
    m = _decoder(1, d_model, n_layers)
    pol = _policy(2, d_model, n_layers)
    with torch.no_grad():       # sharper than the init's near-uniform distribution
        for p in pol.parameters():
            p.mul_(10)
    got = _decoder_results(m)
    got_ro = [_rollout_results(pol, t, p) for t, p in ((0.7, 1.0), (1.0, 0.9), (0.0, 1.0))]
    reference()
    want = _decoder_results(m)
    want_ro = [_rollout_results(pol, t, p) for t, p in ((0.7, 1.0), (1.0, 0.9), (0.0, 1.0))]
    assert _equal(want, got)
    assert want_ro == got_ro
    assert {len(r) for ro in got_ro for r in ro[0]} != {24}     # some rows stopped at EOS


def test_kv_cache_repeat_interleave_equals_reorder():
    cfg = DecoderConfig(vocab_size=11, d_model=16, n_layers=2, n_heads=2)
    m = Decoder(cfg)
    ids = torch.randint(0, 11, (3, 5))
    mask = torch.arange(5)[None] >= torch.tensor([0, 2, 4])[:, None]      # left padding
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    caches = [m.new_cache(3, 9), m.new_cache(3, 9)]
    for c in caches:
        with torch.no_grad():
            m.hidden(ids, mask, pos, c)
    caches[0].reorder(torch.arange(3).repeat_interleave(4))
    caches[1].repeat_interleave(4)
    a, b = caches
    assert a.length == b.length == 5 and torch.equal(a.key_mask, b.key_mask)
    for x, y in zip(a.k + a.v, b.k + b.v):
        assert x.shape == y.shape == (12, 2, 9, 8)
        assert torch.equal(x[:, :, :5], y[:, :, :5])
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
            b.repeat_interleave(bad)
    assert isinstance(b, KVCache)


# -- Policy.continuation_logprobs ----------------------------------------------------------------
def _policy_results(pol):
    tok = pol.tokenizer
    g = torch.Generator().manual_seed(0)
    prompts = [tok.prompt_ids(q) for q in ("What is 2+3?", "7*8=?", "Tom has 12 apples.")]
    lens = [5, 0, 1, 9, 3, 0, 9, 2]
    resps = [torch.randint(4, tok.vocab_size, (n,), generator=g).tolist() for n in lens]
    resps[3][-1] = tok.eos_id
    rows = [2, 0, 0, 1, 2, 1, 0, 2]
    pol.zero_grad(set_to_none=True)
    states = pol.encode_prompts(prompts)
    leaves = states.detached()
    lp, mask = pol.continuation_logprobs(leaves, rows, resps, temperature=0.7)
    (lp * torch.linspace(-1, 2, lp.numel()).view_as(lp)).sum().backward()
    states.backward_from(leaves)
    out = [lp.detach(), mask] + [p.grad for p in pol.parameters()]
    # the shared-prompt path of response_logprobs, and a batch of empty responses only
    lp2, mask2 = pol.response_logprobs([prompts[i] for i in rows], resps)
    lp3, mask3 = pol.continuation_logprobs(states, [0, 1], [[], []])
    return out + [lp2.detach(), mask2, lp3, mask3]


@pytest.mark.parametrize("tokenizer", ["char", "qwen3"])
def test_continuation_logprobs_equal_reference(reference, tokenizer):
    pol = _policy(4, 64, 2, tokenizer)
    got = _policy_results(pol)
    reference()
    want = _policy_results(pol)
    assert _equal(want, got)
    assert got[-1].shape == (2, 0) and got[-2].shape == (2, 0)


def test_continuation_logprobs_bad_ids_still_named(reference):
    pol = _policy(4, 64, 2)
    states = pol.encode_prompts([pol.tokenizer.prompt_ids("1+1?")])
    for bad in (-1, pol.tokenizer.vocab_size):
        with pytest.raises(ValueError, match=f"response id {bad} is outside the vocabulary"):
            pol.continuation_logprobs(states, [0, 0], [[5, 6], [7, bad]])
    with pytest.raises(ValueError, match="prompt index out of range"):
        pol.continuation_logprobs(states, [1], [[5]])


# -- prefix_cat ----------------------------------------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2])
def test_prefix_cat_equals_index_select_and_cat(threads):
    torch.set_num_threads(threads)     # the one_thread fixture restores the count
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        P, N, Lp, Lr = (int(torch.randint(1, hi, (), generator=g)) for hi in (9, 40, 30, 9))
        idx = torch.randint(0, P, (N,), generator=g)   # unsorted, some prefixes without rows
        if seed % 2:
            idx = idx.sort().values                     # grouped, as the trainer calls it
        kp0 = torch.randn(P, 2, Lp, 4, generator=g) * 100
        kr0 = torch.randn(N, 2, Lr, 4, generator=g)
        up = torch.randn(N, 2, Lp + Lr, 4, generator=g) * torch.rand(N, 1, 1, 1, generator=g) ** 4

        def run(fn):
            kp, kr = kp0.clone().requires_grad_(), kr0.clone().requires_grad_()
            out = fn(kp, kr)
            out.backward(up)
            return out.detach(), kp.grad, kr.grad

        want = run(lambda kp, kr: torch.cat([kp.index_select(0, idx), kr], dim=2))
        assert _equal(want, run(lambda kp, kr: prefix_cat(kp, kr, idx))), seed
    with pytest.raises(IndexError, match="out of range"):
        prefix_cat(kp0, kr0[:2], torch.tensor([0, P]))
    with pytest.raises(IndexError, match="out of range"):
        prefix_cat(kp0, kr0[:1], torch.tensor([-1]))


def test_qkv_rope_second_order_gradients_and_mixed_dtypes_follow_the_formula():
    """Beyond the bitwise paths: create_graph=True gets a differentiable gradient (the fast
    backward writes with out=, which autograd cannot record), and cos/sin of another dtype
    than y (autocast) take the formula itself, whose result type promotes."""
    from hacpo.models.decoder import apply_rope, qkv_rope, rope_cos_sin

    B, L, H, Dh = 2, 5, 3, 8
    g = torch.Generator().manual_seed(0)
    y = torch.randn(B, L, 3 * H * Dh, dtype=torch.float64, generator=g, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(L).expand(B, L), Dh, 10000.0, torch.float64)

    def ref(y):
        q, k, v = y.view(B, L, 3, H, Dh).permute(2, 0, 3, 1, 4)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def grads(f):
        q, k, v = f(y)
        (g1,) = torch.autograd.grad((q ** 3).sum() + (k * q).sum() + (v ** 2).sum(), y,
                                    create_graph=True)
        (g2,) = torch.autograd.grad((g1 ** 2).sum(), y)
        return g1.detach(), g2

    for a, b in zip(grads(ref), grads(lambda y: qkv_rope(y, cos, sin, H, Dh))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    yb = y.detach().to(torch.bfloat16)
    q, k, v = qkv_rope(yb, cos.float(), sin.float(), H, Dh)
    assert q.dtype == k.dtype == torch.float32 and v.dtype == torch.bfloat16
    assert torch.equal(q, apply_rope(yb.view(B, L, 3, H, Dh).permute(2, 0, 3, 1, 4)[0],
                                     cos.float(), sin.float()))
