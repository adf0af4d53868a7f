"""A policy's two ways from the response tokens' hidden states to their log-probs
(``agents.N.policy.lm_head``), forward + backward, side by side in one run:

    logits   F.linear(hidden, weight) -> logits [T, V], then hacpo.kernels.token_logprobs
    fused    hacpo.kernels.fused_linear_token_logprobs(hidden, weight, targets)

    PYTHONPATH=. python benchmarks/bench_policy_lm_head.py [--T 2048 --H 512 --V 65536]
        [--reps 5] [--threads 2] [--json PATH]

CPU, fp32. Each mode runs in a fresh process (memory a mode freed would otherwise be reused
unseen; a fixed malloc mmap threshold so freed tensors leave the resident set); per rep: peak
resident memory above the level before the call (VmHWM reset through /proc/self/clear_refs),
which includes the gradients both modes must produce (hidden [T, H], weight [V, H]); the first
rep is a warm-up. Prints p50 time and the largest peak per mode, and the ratios; both modes'
log-probs and gradients are checked to agree.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks._megatron_bench import reset_peak, status_kb  # noqa: E402
from benchmarks._timing import pct, positive_int, results_file  # noqa: E402

MODES = ("logits", "fused")


def _run(mode: str, T: int, H: int, V: int, reps: int) -> dict:
    import torch.nn.functional as F

    from hacpo.kernels import fused_linear_token_logprobs, token_logprobs

    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(T, H, generator=g)
    w = torch.nn.Parameter(torch.randn(V, H, generator=g) / H ** 0.5)
    t = torch.randint(0, V, (T,), generator=g)
    up = torch.randn(T, generator=g)
    times, peaks = [], []
    for _ in range(reps + 1):
        h = h0.clone().requires_grad_()
        w.grad = None
        base = status_kb("VmRSS")
        reset_peak()
        t0 = time.perf_counter()
        lp = token_logprobs(F.linear(h, w), t) if mode == "logits" else \
            fused_linear_token_logprobs(h, w, t)
        lp.backward(up)
        times.append(time.perf_counter() - t0)
        peaks.append((status_kb("VmHWM") - base) / 1024)
    return {"mode": mode, "seconds": times[1:], "peak_mib": max(peaks[1:]),
            "checksums": [float(lp.double().sum()), float(h.grad.double().abs().sum()),
                          float(w.grad.double().abs().sum())]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=positive_int, default=2048)
    p.add_argument("--H", type=positive_int, default=512)
    p.add_argument("--V", type=positive_int, default=65536)
    p.add_argument("--reps", type=positive_int, default=5)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        torch.set_num_threads(a.threads)
        print(json.dumps(_run(a.child, a.T, a.H, a.V, a.reps)))
        return 0
    if not os.path.exists("/proc/self/clear_refs"):
        p.error("needs Linux /proc (peak RSS reset through /proc/self/clear_refs)")
    if a.json:
        results_file(p, a.json)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rows = {}
    for mode in MODES:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode,
                              "--T", str(a.T), "--H", str(a.H), "--V", str(a.V), "--reps",
                              str(a.reps), "--threads", str(a.threads)],
                             capture_output=True, text=True, env=env, check=True)
        rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    lo, fu = rows["logits"], rows["fused"]
    # fp32, the same GEMM rows and log-softmax kernel; sums over T*H and V*H entries
    same = all(abs(x - y) <= 1e-4 * max(1.0, abs(x)) for x, y in
               zip(lo["checksums"], fu["checksums"]))
    ratio_t = pct(fu["seconds"], 0.5) / pct(lo["seconds"], 0.5)
    ratio_m = fu["peak_mib"] / lo["peak_mib"]
    print(f"T={a.T} H={a.H} V={a.V} fp32, {a.threads} threads, {a.reps} reps "
          f"(logits of one call: {a.T * a.V * 4 / 2 ** 20:.0f} MiB)")
    for r in (lo, fu):
        print(f"{r['mode']:>7}: p50 {pct(r['seconds'], 0.5):.3f} s, peak "
              f"{r['peak_mib']:.0f} MiB")
    print(f"fused / logits: time {ratio_t:.2f}x, peak memory {ratio_m:.2f}x; same results: "
          f"{same}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"T": a.T, "H": a.H, "V": a.V, "threads": a.threads, "rows": rows,
                       "time_fused_over_logits": ratio_t, "peak_fused_over_logits": ratio_m,
                       "same_results": same, "torch": torch.__version__}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
