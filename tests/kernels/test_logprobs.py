"""token_logprobs / sequence_mean_logprobs, chunked torch backend (CPU), against the reference."""
import subprocess
import sys

import pytest
import torch

from hacpo.kernels import logprobs as LP
from hacpo.kernels import (fused_linear_token_logprobs, sequence_mean_logprobs, token_logprobs,
                           token_logprobs_reference)
from hacpo.kernels._common import resolve_backend
from tests.kernels import _checks as C

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_three_way(dtype, temperature):
    # odd shapes; rows 0-2 are the special rows (-inf row, +-1e4 row, target at the max)
    C.check_token_logprobs(backend="torch", device="cpu", dtype=dtype, T=1823, V=781,
                           temperature=temperature)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_extreme_logits(dtype):
    # every row at +-1e4 scale: softmax is one-hot-like, logp of non-max targets ~ -2e4
    C.check_token_logprobs(backend="torch", device="cpu", dtype=dtype, T=97, V=781, scale=1e4,
                           temperature=1.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequence_mean_logprobs(dtype):
    C.check_sequence_mean(backend="torch", device="cpu", dtype=dtype, T=1823, V=781, S=13,
                          temperature=0.8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy(dtype):
    C.check_entropy(backend="torch", device="cpu", dtype=dtype, T=301, V=781, temperature=0.9)


def test_results_do_not_depend_on_row_chunking(monkeypatch):
    x, t = C.make_logits(203, 781, torch.bfloat16, "cpu")
    g = torch.randn(203)
    outs = []
    for elems, rows in ((1 << 20, 1342), (781 * 7, 7), (1, 1)):   # one chunk, 7 rows, 1 row
        monkeypatch.setattr(LP, "ROW_CHUNK_ELEMS", elems)
        assert LP._rows_per_chunk(781) == rows      # else the loop never runs several chunks
        xk = x.clone().requires_grad_()
        lp = token_logprobs(xk, t, temperature=0.9, backend="torch")
        lp.backward(g)
        outs.append((lp.detach(), xk.grad))
    for lp, gr in outs[1:]:
        # row-wise math: chunking only changes which rows share a loop iteration -> bitwise equal
        assert torch.equal(lp, outs[0][0]) and torch.equal(gr, outs[0][1])


def test_row_chunks_stay_within_their_element_budget():
    """A chunk holds at most ROW_CHUNK_ELEMS logits, whatever T; a row wider than the budget
    is a chunk of its own."""
    for V in (1, 781, 32000, 151936, LP.ROW_CHUNK_ELEMS):
        rows = LP._rows_per_chunk(V)
        budget = LP.ROW_CHUNK_ELEMS
        assert rows >= 1 and rows * V <= budget and (rows + 1) * V > budget
    assert LP._rows_per_chunk(LP.ROW_CHUNK_ELEMS + 1) == 1


def test_auto_backend_is_torch_on_cpu():
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("torch", torch.device("cpu")) == "torch"


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        token_logprobs(torch.randn(4, 10), torch.tensor([0, 1, 2, 3]), backend="triton")


def test_import_does_not_import_triton():
    code = "import sys, hacpo.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _x(T=6, V=10):
    return torch.randn(T, V), torch.randint(0, V, (T,))


@pytest.mark.parametrize("case, match", [
    ("target_high", "target out of range at row 3"),
    ("target_negative", "target out of range at row 1"),
    ("nan_logits", "non-finite log-prob at row 2"),
    ("posinf_logits", "non-finite log-prob at row 4"),
    ("neginf_target", "non-finite log-prob at row 5"),
    ("length_mismatch", "length mismatch"),
    ("logits_1d", r"logits must be \[T, V\]"),
    ("float_targets", "integer"),
    ("int_logits", "dtype"),
    ("zero_vocab", r"V >= 1"),
    ("temperature_zero", "temperature"),
    ("temperature_string", r"temperature must be a finite number > 0, got '0.7'"),  # was taken
    # 1/1e-40 is inf in float32: the error blamed the logits ("NaN or +inf")
    ("temperature_tiny", r"temperature 1e-40 is too small: 1/temperature overflows float32"),
    ("bad_backend", "backend must be one of"),
])
def test_invalid_token_inputs(case, match):
    x, t = _x()
    kw = {}
    if case == "target_high":
        t[3] = 10
    elif case == "target_negative":
        t[1] = -1
    elif case == "nan_logits":
        x[2, 7] = float("nan")
    elif case == "posinf_logits":
        x[4, 0] = float("inf")
    elif case == "neginf_target":
        x[5, t[5]] = float("-inf")
    elif case == "length_mismatch":
        t = t[:-1]
    elif case == "logits_1d":
        x = x[0]
    elif case == "float_targets":
        t = t.float()
    elif case == "int_logits":
        x = x.long()
    elif case == "zero_vocab":
        x = x[:, :0]
    elif case == "temperature_zero":
        kw["temperature"] = 0.0
    elif case == "temperature_string":
        kw["temperature"] = "0.7"
    elif case == "temperature_tiny":
        kw["temperature"] = 1e-40
    elif case == "bad_backend":
        kw["backend"] = "cuda"
    with pytest.raises(ValueError, match=match):
        token_logprobs(x, t, **kw)


def test_validate_false_skips_the_check():
    x, t = _x()
    t[0] = 10                                   # out of range: with validate=False no sync, no
    out = token_logprobs(x, t, validate=False)  # error, and no out-of-bounds read either
    assert out.shape == (6,) and torch.isfinite(out[1:]).all()


@pytest.mark.parametrize("cu, match", [
    ([0, 2, 2, 6], "sequence 1 has length 0"),
    ([0, 3, 5], "does not match T"),
    ([1, 3, 6], "must start at 0"),
    ([0, 4, 3, 6], "sequence 1 has length -1"),
    ([6], r"\[S\+1\]"),
])
def test_invalid_cu_seqlens(cu, match):
    x, t = _x()
    with pytest.raises(ValueError, match=match):
        sequence_mean_logprobs(x, t, torch.tensor(cu))
    if min(cu) >= 0:        # uint8 boundaries: a length of -1 wrapped to 255 and passed
        with pytest.raises(ValueError, match=match):
            sequence_mean_logprobs(x, t, torch.tensor(cu, dtype=torch.uint8))


def test_chunked_path_saves_no_float32_TxV_for_bf16():
    T, V = 256, 4096
    x, t = C.make_logits(T, V, torch.bfloat16, "cpu", special_rows=False)
    x.requires_grad_()
    big_f32 = lambda saved: [s for s in saved if s[1] == torch.float32 and  # noqa: E731
                             torch.Size(s[0]).numel() >= T * V]
    saved, _ = C.saved_tensor_summaries(lambda: token_logprobs(x, t, backend="torch"))
    assert saved, "hook saw nothing: the check would be vacuous"
    assert not big_f32(saved), saved
    # the check can fail: the reference (upcast + log_softmax) does save a [T, V] float32
    saved_ref, _ = C.saved_tensor_summaries(lambda: token_logprobs_reference(x, t))
    assert big_f32(saved_ref)
    # and nothing [T, V]-sized besides the bf16 input itself is saved
    assert [s for s in saved if torch.Size(s[0]).numel() >= T * V] == [((T, V), torch.bfloat16)]


@pytest.mark.parametrize("bug", ["ignores_temperature", "bf16_math", "off_by_one_row"])
def test_three_way_check_catches_a_broken_kernel(monkeypatch, bug):
    """The tolerances can fail: plausible kernel bugs are caught by the same check."""
    def broken(x, t, temperature=1.0, backend="torch"):
        if bug == "ignores_temperature":
            return token_logprobs(x, t, backend=backend)
        if bug == "bf16_math":   # log-softmax computed in the input precision
            return token_logprobs_reference(x, t, temperature=temperature,
                                            compute_dtype=x.dtype).float()
        return token_logprobs(x, t.roll(1), temperature=temperature, backend=backend,
                              validate=False)
    monkeypatch.setattr(C, "token_logprobs", broken)
    with pytest.raises(AssertionError):
        C.check_token_logprobs(backend="torch", device="cpu", dtype=torch.bfloat16, T=64, V=781,
                               temperature=0.7)


def _double_backward_cases():
    x, t = _x()
    h, w = torch.randn(6, 4), torch.randn(10, 4)
    return {
        "token_fp32": (lambda a: token_logprobs(a[0], t), [x]),
        "token_bf16_temp": (lambda a: token_logprobs(a[0], t, temperature=0.7),
                            [x.bfloat16()]),
        "fused": (lambda a: fused_linear_token_logprobs(a[0], a[1], t, chunk_size=4), [h, w]),
    }


@pytest.mark.parametrize("case", ["token_fp32", "token_bf16_temp", "fused"])
@pytest.mark.parametrize("upstream", ["sum", "square"])
def test_double_backward_is_a_clear_error(case, upstream):
    """The backward is not differentiable. create_graph=True must still give the first-order
    grads; differentiating them again must raise, also when the upstream grad is a constant
    (`logp.sum()`), where an error node on the upstream grads alone sees nothing requiring grad
    and the second-order terms would silently be missing."""
    fn, inputs = _double_backward_cases()[case]
    ins = [a.detach().clone().requires_grad_() for a in inputs]
    out = fn(ins)
    grads = torch.autograd.grad(out.sum() if upstream == "sum" else out.pow(2).sum(), ins,
                                create_graph=True)
    ref_ins = [a.detach().clone().requires_grad_() for a in inputs]
    ref = fn(ref_ins)
    ref_grads = torch.autograd.grad(ref.sum() if upstream == "sum" else ref.pow(2).sum(),
                                    ref_ins)
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a.detach(), b)
    second = sum(gr.float().pow(2).sum() for gr in grads) + sum(a.float().sum() for a in ins)
    with pytest.raises(RuntimeError, match="differentiable once"):
        second.backward()
