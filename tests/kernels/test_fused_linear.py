"""fused_linear_token_logprobs: chunked over T, logits never materialised."""
import pytest
import torch

from hacpo.kernels import fused_linear_token_logprobs
from hacpo.kernels.fused_linear import default_chunk_size
from tests.kernels import _checks as C


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [37, None])
def test_fused_linear_three_way(dtype, chunk_size):
    C.check_fused_linear(backend="torch", device="cpu", dtype=dtype, T=301, H=64, V=781,
                         temperature=0.8, chunk_size=chunk_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_padded_vocabulary(dtype):
    # 19 padding rows (Megatron-style: the last ids); chunks of 37 rows at temperature 0.8
    C.check_fused_linear(backend="torch", device="cpu", dtype=dtype, T=301, H=64, V=781,
                         temperature=0.8, chunk_size=37, pad=19)


def test_fused_linear_frozen_weight_and_entropy():
    h = torch.randn(50, 16, requires_grad=True)
    w = torch.randn(300, 16)                         # frozen lm_head: no weight grad computed
    t = torch.randint(0, 300, (50,))
    lp, ent = fused_linear_token_logprobs(h, w, t, chunk_size=8, return_entropy=True)
    lp.sum().backward()
    logits = (h @ w.t()).double()
    ref_ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    # entropy from fp32 lse and E[z - m]: a few fp32 ulps of |z| (<= ~30 here)
    assert (ent.double() - ref_ent).abs().max() < 1e-4
    href = h.detach().clone().requires_grad_()
    torch.log_softmax(href @ w.t(), -1).gather(1, t[:, None]).sum().backward()
    # fp32 GEMMs with H=16 and V=300 terms: 1e-5 relative to |grad| <= ~10
    assert torch.allclose(h.grad, href.grad, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("device, budget", [("cpu", 1 << 25), ("cuda", 1 << 26)])
def test_default_chunk_size_keeps_a_chunk_within_its_budget(device, budget):
    """A chunk's logits stay within 32 Mi elements on CPU, 64 Mi on GPU, however long T is; a
    short T is one chunk; a vocabulary shard wider than the budget gets one-row chunks."""
    dev = torch.device(device)                      # a device object only: no GPU needed
    assert default_chunk_size(1 << 20, 65536, dev) == budget // 65536
    for T, V in ((1 << 20, 151936), (10 ** 6, 781), (4096, 32000)):
        c = default_chunk_size(T, V, dev)
        assert 1 <= c <= T and c * V <= budget
    assert default_chunk_size(100, 781, dev) == 100
    assert default_chunk_size(1 << 20, budget + 1, dev) == 1


def test_fused_linear_under_autocast():
    C.check_fused_linear_under_autocast("torch")


def test_fused_linear_saves_no_TxV_tensor():
    T, V, H = 128, 2048, 32
    h = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (T,))
    saved, _ = C.saved_tensor_summaries(
        lambda: fused_linear_token_logprobs(h, w, t, chunk_size=16))
    assert saved and all(torch.Size(s[0]).numel() < T * V for s in saved), saved


@pytest.mark.parametrize("kw, match", [
    (dict(hidden_shape=(10, 8), weight_shape=(20, 9)), "need hidden"),
    (dict(weight_dtype=torch.bfloat16), "dtype"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=2.5), r"chunk_size must be an integer >= 1, got 2.5"),   # was truncated
    (dict(bad_target=25), "target out of range at row 4"),
    (dict(bad_target=17, vocab_size=16), "target out of range at row 4"),   # a padding id
    (dict(vocab_size=21), "vocab_size must be in"),
    (dict(vocab_size=0), "vocab_size must be in"),
    (dict(vocab_size=15.9), r"vocab_size must be a whole number, got 15.9"),   # was 15
    (dict(vocab_size=True), r"vocab_size must be a whole number, got True"),
    (dict(weight_device="meta"), "hidden on cpu, weight on meta"),
])
def test_fused_linear_invalid(kw, match):
    h = torch.randn(*kw.get("hidden_shape", (10, 8)))
    w = torch.randn(*kw.get("weight_shape", (20, 8))).to(kw.get("weight_dtype", torch.float32))
    w = w.to(kw.get("weight_device", "cpu"))
    t = torch.randint(0, 16, (10,))
    if "bad_target" in kw:
        t[4] = kw["bad_target"]
    with pytest.raises(ValueError, match=match):
        fused_linear_token_logprobs(h, w, t, chunk_size=kw.get("chunk_size", 4),
                                    **({"vocab_size": kw["vocab_size"]} if "vocab_size" in kw
                                       else {}))
