"""Tests written for mutants of the kernels' loss entry points that the other tests let through
(mutation audit). Expected values are float64 recomputations from the definitions."""
import pytest
import torch

from hacpo.kernels import hacpo_loss_from_hidden, hacpo_loss_from_logits


def _inputs(T=11, V=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 4, 5, T])
    S = cu.numel() - 1
    return dict(targets=torch.randint(0, V, (T,), generator=g), cu_seqlens=cu,
                old_lp=torch.full((S,), -3.0), advantages=torch.randn(S, generator=g),
                is_self=torch.tensor([True, False, True]), omega=torch.tensor([1.0, 2.0, 1.0]),
                minibatch_index=0), g


def test_entropy_metric_is_the_token_mean_entropy():
    """metrics["entropy_mean"]: the mean over the minibatch's tokens of the entropy of
    softmax(logits / temperature)."""
    kw, g = _inputs()
    logits = torch.randn(11, 37, generator=g) * 2
    _, met = hacpo_loss_from_logits(logits, temperature=0.7, with_entropy=True, **kw)
    p = torch.softmax(logits.double() / 0.7, -1)
    want = -(p * p.log()).sum(-1).mean()
    assert float(met["entropy_mean"]) == pytest.approx(float(want), rel=1e-5)


def test_from_hidden_target_in_the_padding_is_out_of_range():
    """A padded weight (vocab_size < rows): a target id in the padding rows is a target outside
    the real vocabulary, reported as such (not as a non-finite log-prob)."""
    kw, g = _inputs()
    hidden = torch.randn(11, 8, generator=g)
    weight = torch.randn(40, 8, generator=g)          # 37 real ids + 3 padding rows
    kw["targets"][6] = 38
    with pytest.raises(ValueError, match="target out of range at row 6"):
        hacpo_loss_from_hidden(hidden, weight, vocab_size=37, **kw)


def test_fused_linear_bf16_grad_weight_over_many_chunks():
    """grad_weight of a bf16 weight summed over 192 one-row chunks is accumulated in fp32 and
    rounded once: as accurate as the one-GEMM bf16 reference (K x its error). Accumulating in
    bf16 adds a rounding per chunk (measured 0.12 vs the reference's 0.036)."""
    from tests.kernels import _checks as C
    C.check_fused_linear(backend="torch", device="cpu", dtype=torch.bfloat16, T=192, H=16, V=64,
                         chunk_size=1)
