"""Triton kernels compiled for real on a CUDA GPU: the same checks as tests/kernels (imported
from tests/kernels/_checks.py), runnable without pytest.

    PYTHONPATH=<repo root> python benchmarks/gpu_correctness.py RESULTS_DIR

Exits non-zero if any check fails; writes RESULTS_DIR/correctness.json. TRITON_INTERPRET must
be unset (the point is the compiled kernels).
"""
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from tests.kernels import _checks as C  # noqa: E402


def large_row_offsets():
    """T * V > 2**31: int64 row offsets in the kernels (5 GB of bf16 logits)."""
    from hacpo.kernels import token_logprobs
    T, V = 16384, 151937
    x = torch.randn(T, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (T,), device="cuda")
    lp = token_logprobs(x, t, backend="triton")
    g = torch.randn(T, device="cuda")
    lp.backward(g)
    rows = torch.tensor([0, T // 2, T - 1], device="cuda")
    xr = x.detach()[rows].double().requires_grad_()
    ref = torch.log_softmax(xr, -1).gather(1, t[rows, None]).squeeze(1)
    ref.backward(g[rows].double())
    # fwd: fp32 math over 1.5e5 terms vs fp64: 1e-4 abs on |logp| ~ 12-15;
    # grad: bf16 output rounding, 2^-8 relative to the largest |grad| in those rows
    fe = float((lp.detach()[rows].double() - ref.detach()).abs().max())
    ge = float((x.grad[rows].double() - xr.grad).abs().max())
    gmax = float(xr.grad.abs().max())
    assert fe < 1e-4, fe
    assert ge <= 2.0 ** -8 * gmax + 1e-6, (ge, gmax)
    return {"fwd_err": fe, "grad_err": ge}


CHECKS = [
    ("token fp32 T1823 V781 temp0.7", lambda: C.check_token_logprobs(
        backend="triton", device="cuda", dtype=torch.float32, T=1823, V=781, temperature=0.7)),
    ("token bf16 T1823 V781", lambda: C.check_token_logprobs(
        backend="triton", device="cuda", dtype=torch.bfloat16, T=1823, V=781)),
    ("token fp16 T1823 V781 temp1.3", lambda: C.check_token_logprobs(
        backend="triton", device="cuda", dtype=torch.float16, T=1823, V=781, temperature=1.3)),
    ("token bf16 T2048 V151936", lambda: C.check_token_logprobs(
        backend="triton", device="cuda", dtype=torch.bfloat16, T=2048, V=151936)),
    ("token bf16 extreme 1e4", lambda: C.check_token_logprobs(
        backend="triton", device="cuda", dtype=torch.bfloat16, T=257, V=32007, scale=1e4)),
    ("triton == torch bf16", lambda: C.check_triton_matches_torch(
        device="cuda", dtype=torch.bfloat16, T=1823, V=32007, temperature=0.9)),
    ("triton == torch fp32", lambda: C.check_triton_matches_torch(
        device="cuda", dtype=torch.float32, T=1823, V=32007)),
    ("entropy bf16", lambda: C.check_entropy(
        backend="triton", device="cuda", dtype=torch.bfloat16, T=1823, V=32007, temperature=0.8)),
    ("sequence mean bf16", lambda: C.check_sequence_mean(
        backend="triton", device="cuda", dtype=torch.bfloat16, T=1823, V=781, S=13)),
    ("fused linear fp32", lambda: C.check_fused_linear(
        backend="triton", device="cuda", dtype=torch.float32, T=1001, H=256, V=32007,
        chunk_size=300)),
    ("fused linear bf16", lambda: C.check_fused_linear(
        backend="triton", device="cuda", dtype=torch.bfloat16, T=1001, H=256, V=32007)),
    ("fused linear fp32 under bf16 autocast", lambda: C.check_fused_linear_under_autocast(
        "triton", device="cuda", T=1001, H=256, V=32007)),
    ("torch backend on cuda bf16", lambda: C.check_token_logprobs(
        backend="torch", device="cuda", dtype=torch.bfloat16, T=1823, V=781)),
    ("int64 row offsets T*V > 2^31", large_row_offsets),
]


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device; the compiled Triton checks need a GPU")
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: unset it to test the compiled kernels")
        return 2
    results, failed = [], 0
    for name, fn in CHECKS:
        t0 = time.time()
        try:
            info = fn()
            status = "PASS"
        except Exception as e:  # noqa: BLE001 - report every check, then fail at the end
            info, status = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}", "FAIL"
            failed += 1
        dt = time.time() - t0
        print(f"{status} {name} ({dt:.1f}s) {info if status == 'PASS' else ''}", flush=True)
        if status == "FAIL":
            print(info, flush=True)
        results.append({"check": name, "status": status, "seconds": dt, "info": str(info)})
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "correctness.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "results": results}, f, indent=1)
    print(f"{len(results) - failed}/{len(results)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
