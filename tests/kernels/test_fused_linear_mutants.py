"""fused_linear_token_logprobs: the input checks and vocabulary bounds a mutation audit found
untested (a dtype outside the three supported, malformed targets, vocab_size at the edge of the
weight, a vocabulary shard holding only padding)."""
import pytest
import torch

from hacpo.kernels import (fused_linear, fused_linear_token_logprobs,
                           fused_linear_token_logprobs_reference)


def _inputs(T=10, H=8, V=20, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(T, H, generator=gen).to(dtype), torch.randn(V, H, generator=gen).to(dtype),
            torch.randint(0, V, (T,), generator=gen))


@pytest.mark.parametrize("targets, match", [
    (lambda t: t[:-1], r"length mismatch: targets has 9 entries, logits/hidden have T=10 rows"),
    (lambda t: t[:, None], r"targets must be \[T\], got shape \(10, 1\)"),
    (lambda t: t.float(), r"targets must be an integer tensor, got torch.float32"),
    (lambda t: t.bool(), r"targets must be an integer tensor, got torch.bool"),
])
def test_malformed_targets_are_named(targets, match):
    h, w, t = _inputs()
    with pytest.raises(ValueError, match=match):
        fused_linear_token_logprobs(h, w, targets(t), chunk_size=4)


def test_float64_inputs_are_refused():
    h, w, t = _inputs(dtype=torch.float64)
    with pytest.raises(ValueError, match=r"dtype must be float32/bfloat16/float16, got "
                                         r"torch.float64"):
        fused_linear_token_logprobs(h, w, t, chunk_size=4)


def test_vocab_size_equal_to_the_weight_rows_is_no_padding():
    """vocab_size = V (every row real) is valid and the same as leaving it out."""
    h, w, t = _inputs()
    t[3] = 19                                        # the last row is a real id
    full = fused_linear_token_logprobs(h, w, t, chunk_size=4)
    same = fused_linear_token_logprobs(h, w, t, chunk_size=4, vocab_size=20)
    assert torch.equal(same, full)
    ref = torch.log_softmax(h.double() @ w.double().t(), -1).gather(1, t[:, None])[:, 0]
    torch.testing.assert_close(full.double(), ref, atol=1e-5, rtol=0)


def test_reference_leaves_out_the_padding_rows():
    """The spec's vocab_size: rows past it take no part in the softmax (large padding rows
    here, which would take most of the probability)."""
    h, w, t = _inputs(V=16)
    w_pad = torch.cat([w, torch.full((4, 8), 3.0)])
    ref = fused_linear_token_logprobs_reference(h, w_pad, t, vocab_size=16)
    assert torch.equal(ref, fused_linear_token_logprobs_reference(h, w, t))
    # the kernel on the same padded weight: fp32 rounding only (a leak moves it by nats)
    ker = fused_linear_token_logprobs(h, w_pad, t, vocab_size=16, chunk_size=3)
    torch.testing.assert_close(ker, ref, atol=1e-5, rtol=0)


def test_vocab_shard_of_only_padding_and_tp_bounds(monkeypatch):
    """With tp_group, the bounds are over the whole group's vocabulary, and a rank whose shard
    lies entirely past vocab_size is an error (its logits would all be -inf). Rank 1 of 2 is
    faked through vocab_layout: no process group needed, both errors come before any
    communication."""
    monkeypatch.setattr(fused_linear, "vocab_layout", lambda v_local, group: (v_local, 2 * v_local))
    h, w, t = _inputs()
    with pytest.raises(ValueError, match=r"vocab_size must be in \[1, 40\] \(the rows of weight "
                                         r"over the TP group\), got 41"):
        fused_linear_token_logprobs(h, w, t, tp_group=object(), vocab_size=41)
    with pytest.raises(ValueError, match=r"this rank's vocabulary shard \(ids 20\.\.39\) holds "
                                         r"only padding \(vocab_size 20\)"):
        fused_linear_token_logprobs(h, w, t, tp_group=object(), vocab_size=20)
