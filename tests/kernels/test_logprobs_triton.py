"""Triton backend: compiled on CUDA, under TRITON_INTERPRET=1 on CPU (small shapes: the
interpreter is ~100x slower than torch)."""
import pytest
import torch

from hacpo.kernels import token_logprobs
from hacpo.kernels._common import resolve_backend
from tests.kernels import _checks as C

pytestmark = pytest.mark.triton_interpret


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_token_logprobs_three_way(triton_device, dtype):
    C.check_token_logprobs(backend="triton", device=triton_device, dtype=dtype, T=33,
                           V=2048 + 37, temperature=0.7)        # V not a multiple of BLOCK_V


def test_triton_extreme_logits(triton_device):
    C.check_token_logprobs(backend="triton", device=triton_device, dtype=torch.bfloat16, T=9,
                           V=4999, scale=1e4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_torch_backend(triton_device, dtype):
    C.check_triton_matches_torch(device=triton_device, dtype=dtype, T=17, V=5000,
                                 temperature=0.9)


def test_triton_entropy(triton_device):
    C.check_entropy(backend="triton", device=triton_device, dtype=torch.bfloat16, T=20, V=4500,
                    temperature=0.8)


def test_triton_sequence_mean(triton_device):
    C.check_sequence_mean(backend="triton", device=triton_device, dtype=torch.float32, T=40,
                          V=999, S=5)


@pytest.mark.parametrize("pad", [0, 13])
def test_triton_fused_linear(triton_device, pad):
    C.check_fused_linear(backend="triton", device=triton_device, dtype=torch.float32, T=30, H=32,
                         V=1500, chunk_size=7, pad=pad)


def test_triton_fused_linear_under_autocast(triton_device):
    if triton_device != "cpu":
        pytest.skip("checks CPU autocast (bf16)")
    C.check_fused_linear_under_autocast("triton", T=12, H=16, V=200)


def test_triton_double_backward_is_a_clear_error(triton_device):
    """The kernel's gradient has no graph: with create_graph=True and a constant upstream grad
    (logp.sum()), a second differentiation must raise, not silently drop the second-order
    terms (the triton backward builds no autograd graph at all)."""
    x = torch.randn(4, 9, device=triton_device, requires_grad=True)
    t = torch.randint(0, 9, (4,), device=triton_device)
    g, = torch.autograd.grad(token_logprobs(x, t, backend="triton").sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        (g.pow(2).sum() + x.sum()).backward()


@pytest.mark.parametrize("value", ["true", "ON", "yes"])
def test_triton_interpret_read_as_triton_reads_it(triton_device, monkeypatch, value):
    """TRITON_INTERPRET=true/on/yes switch triton's interpreter on as 1 does: backend='triton'
    must then run on CPU, not raise that the interpreter is off."""
    if triton_device != "cpu":
        pytest.skip("the interpreter is a CPU matter")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert resolve_backend("triton", torch.device("cpu")) == "triton"


@pytest.mark.gpu
def test_triton_large_row_offsets():
    """row * stride > 2**31 elements: the kernels must index in int64 (GPU only: ~5 GB)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with >= 16 GB free (5 GB of bf16 logits + grad)")
    T, V = 16384, 151936 - 1 + 2       # T*V > 2**31
    x = torch.randn(T, V, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, V, (T,), device="cuda")
    from hacpo.kernels import token_logprobs
    lp = token_logprobs(x, t, backend="triton")
    rows = torch.tensor([0, T // 2, T - 1], device="cuda")
    ref = torch.log_softmax(x[rows].float(), -1).gather(1, t[rows, None]).squeeze(1)
    # fp32 math on both sides over V ~ 1.5e5 terms: 1e-4 absolute on |logp| ~ 12
    assert (lp[rows] - ref).abs().max() < 1e-4
