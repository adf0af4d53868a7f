"""hacpo_loss_from_logits / _from_hidden equal hacpo.engine.sequence_mean_logprob followed by
hacpo_policy_loss (value, gradient and metrics)."""
import pytest
import torch

from hacpo.engine import hacpo_policy_loss, sequence_mean_logprob
from hacpo.kernels import hacpo_loss_from_hidden, hacpo_loss_from_logits


def _batch(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 1, 12, 7, 9, 3]
    S, T, V, H = len(lengths), sum(lengths), 301, 16
    cu = torch.tensor([0] + lengths).cumsum(0)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / 2).to(dtype)
    targets = torch.randint(0, V, (T,), generator=g)
    is_self = torch.tensor([True, False, True, False, False, False])
    omega = torch.where(is_self, 1.0, torch.tensor([1.0, 2.5, 1.0, 0.4, 1.7, 0.9]))
    adv = torch.randn(S, generator=g)
    # old log-probs around the current ones: some ratios inside the (tiny) self clip range,
    # some cross ratios below lo_m, inside [lo_m, 1] and above 1
    with torch.no_grad():
        logits = (hidden.float() @ weight.float().t())
        lp = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
        new_lp = torch.stack([lp[a:b].mean() for a, b in zip(cu[:-1], cu[1:])])
    old_lp = new_lp + torch.tensor([1e-4, 0.5, -0.3, 0.05, -0.1, 0.0])
    return dict(hidden=hidden, weight=weight, targets=targets, cu=cu, is_self=is_self,
                omega=omega, adv=adv, old_lp=old_lp, lengths=lengths)


def _engine_loss(logits, b, m, divisor, temperature, **kw):
    """The composition the kernels must reproduce: padded token log-probs -> engine."""
    tok = torch.log_softmax(logits.float() / temperature, -1).gather(
        1, b["targets"][:, None]).squeeze(1)
    L = max(b["lengths"])
    pad = torch.zeros(len(b["lengths"]), L)
    mask = torch.zeros(len(b["lengths"]), L, dtype=torch.bool)
    rows = []
    for i, (a, n) in enumerate(zip(b["cu"][:-1].tolist(), b["lengths"])):
        rows.append(torch.cat([tok[a:a + n], tok.new_zeros(L - n)]))
        mask[i, :n] = True
    pad = torch.stack(rows)
    new_lp = sequence_mean_logprob(pad, mask)
    return hacpo_policy_loss(new_lp, b["old_lp"], b["adv"], b["is_self"], b["omega"],
                             minibatch_index=m, divisor=divisor, **kw)


@pytest.mark.parametrize("m, divisor, temperature, kw", [
    (0, None, 1.0, {}),
    (3, 16, 0.8, {}),
    (1, 6, 1.0, dict(alpha=0.0, cross_clip="none")),
])
def test_loss_from_logits_matches_engine(m, divisor, temperature, kw):
    b = _batch()
    logits = (b["hidden"] @ b["weight"].t()).detach()
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss, metrics = hacpo_loss_from_logits(x1, b["targets"], b["cu"], b["old_lp"], b["adv"],
                                           b["is_self"], b["omega"], minibatch_index=m,
                                           divisor=divisor, temperature=temperature, **kw)
    ref, ref_metrics = _engine_loss(x2, b, m, divisor, temperature, **kw)
    loss.backward()
    ref.backward()
    # same fp32 math up to summation order (logsumexp vs log_softmax, index_add vs masked sum):
    # a few fp32 ulps of the O(1-10) quantities involved
    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6), (loss, ref)
    assert torch.allclose(x1.grad, x2.grad, rtol=1e-4, atol=1e-7)
    assert x1.grad.abs().sum() > 0                 # the test exercises a non-trivial gradient
    for k, v in ref_metrics.items():
        assert torch.allclose(metrics[k].float(), v.float(), atol=1e-6), k


def test_loss_from_hidden_matches_engine():
    b = _batch()
    h1, w1 = b["hidden"].clone().requires_grad_(), b["weight"].clone().requires_grad_()
    h2, w2 = b["hidden"].clone().requires_grad_(), b["weight"].clone().requires_grad_()
    loss, metrics = hacpo_loss_from_hidden(h1, w1, b["targets"], b["cu"], b["old_lp"], b["adv"],
                                           b["is_self"], b["omega"], minibatch_index=2,
                                           divisor=10, chunk_size=5, with_entropy=True)
    ref, _ = _engine_loss(h2 @ w2.t(), b, 2, 10, 1.0)
    loss.backward()
    ref.backward()
    # fp32, see above; hidden/weight grads add H=16 / T=37-term GEMM sums
    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(h1.grad, h2.grad, rtol=1e-4, atol=1e-6)
    assert torch.allclose(w1.grad, w2.grad, rtol=1e-4, atol=1e-6)
    assert "entropy_mean" in metrics and metrics["entropy_mean"] > 0


def test_loss_from_hidden_with_padded_weight():
    """A weight padded past the real vocabulary (Megatron's TP padding) with ``vocab_size``:
    the loss and gradients of the unpadded weight; the padding rows get zero gradient. Without
    vocab_size the padding rows would enter the softmax (checked: another loss)."""
    b = _batch()
    V = b["weight"].shape[0]
    padded = torch.cat([b["weight"], torch.randn(11, b["weight"].shape[1])]).requires_grad_()
    w = b["weight"].clone().requires_grad_()
    args = (b["targets"], b["cu"], b["old_lp"], b["adv"], b["is_self"], b["omega"])
    h1, h2 = b["hidden"].clone().requires_grad_(), b["hidden"].clone().requires_grad_()
    loss, _ = hacpo_loss_from_hidden(h1, padded, *args, minibatch_index=1, divisor=8,
                                     chunk_size=7, vocab_size=V)
    ref, _ = hacpo_loss_from_hidden(h2, w, *args, minibatch_index=1, divisor=8, chunk_size=7)
    (loss + ref).backward()
    assert torch.allclose(loss, ref, rtol=1e-6, atol=1e-7)
    assert torch.allclose(h1.grad, h2.grad, rtol=1e-5, atol=1e-7)
    assert torch.allclose(padded.grad[:V], w.grad, rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(padded.grad[V:]) == 0
    unpadded, _ = hacpo_loss_from_hidden(b["hidden"], padded.detach(), *args, minibatch_index=1,
                                         divisor=8)
    assert not torch.allclose(unpadded, ref, rtol=1e-3)
    bad = b["targets"].clone()
    bad[4] = V                                            # a padding id is no token
    with pytest.raises(ValueError, match="target"):
        hacpo_loss_from_hidden(b["hidden"], padded.detach(), bad, *args[1:], minibatch_index=1,
                               vocab_size=V)


def test_loss_rejects_empty_sequence():
    b = _batch()
    logits = b["hidden"] @ b["weight"].t()
    cu = b["cu"].clone()
    cu[2] = cu[1]                                   # sequence 1 now empty
    with pytest.raises(ValueError, match="sequence 1 has length 0"):
        hacpo_loss_from_logits(logits, b["targets"], cu, b["old_lp"], b["adv"], b["is_self"],
                               b["omega"], minibatch_index=0)
    with pytest.raises(ValueError, match="sequence 1 has length 0"):
        hacpo_loss_from_hidden(b["hidden"], b["weight"], b["targets"], cu, b["old_lp"], b["adv"],
                               b["is_self"], b["omega"], minibatch_index=0)


@pytest.mark.parametrize("cu, match", [([0.0, 10.0, 37.0], "integer"), ([37], r"\[S\+1\]")])
def test_cu_seqlens_shape_and_dtype_checked_even_without_validate(cu, match):
    """validate=False skips the host sync only: like sequence_mean_logprobs (and so
    hacpo_loss_from_logits), hacpo_loss_from_hidden checks cu_seqlens' shape and dtype eagerly
    (a float cu_seqlens was silently truncated, a [1] one failed deep in an index_add)."""
    b = _batch()
    args = (b["old_lp"][:2], b["adv"][:2], b["is_self"][:2], b["omega"][:2])
    with pytest.raises(ValueError, match=match):
        hacpo_loss_from_hidden(b["hidden"], b["weight"], b["targets"], torch.tensor(cu), *args,
                               minibatch_index=0, validate=False)
    with pytest.raises(ValueError, match=match):
        hacpo_loss_from_logits(b["hidden"] @ b["weight"].t(), b["targets"], torch.tensor(cu),
                               *args, minibatch_index=0, validate=False)
