"""Microbenchmark: per-sequence mean log-probs from logits, and token log-probs from hidden+weight.

    python benchmarks/bench_logprobs.py [--out DIR] [--quick] [--device cpu|cuda] [--reps N]

Side by side, in one run (every case in a fresh subprocess, so peaks are independent):

  op "logits"  (sequence_mean_logprobs over packed logits [T, V])
    naive   log_softmax(logits.float() / temp).gather(targets) then per-sequence mean
    torch   hacpo.kernels, chunked torch backend
    triton  hacpo.kernels, Triton backend (CUDA only)
    liger   Liger-Kernel's LigerCrossEntropyFunction(reduction="none") = -logp (Triton, CUDA
            only; it writes the gradient into the logits during forward, so each run gets a
            fresh copy of the logits outside the timed region)
  op "fused_linear"  (token log-probs from hidden [T, H] and lm_head weight [V, H])
    naive   (hidden @ weight.T).float() -> log_softmax -> gather
    torch / triton   hacpo.kernels.fused_linear_token_logprobs
    liger   Liger-Kernel's chunked selective log-prob (`_ChunkedSelectiveLogProbFunction`, the
            logprob core of LigerFusedLinearGRPOLoss; pure torch, CPU and GPU)

Modes: fwd (forward building the autograd graph), bwd (backward alone, after an untimed forward),
both (forward + backward). Reported: p20/p50/p80 wall time, peak memory above the inputs
(CPU: VmHWM after resetting it through /proc/self/clear_refs, i.e. the process's real peak
RSS, with a fixed malloc mmap threshold so tensors are mapped on allocation and unmapped when
freed: the resident set follows the live tensors, neither memory freed earlier and reused
unseen nor heap the allocator keeps; measured in a process of its own, apart from the timing
runs, which use glibc's default malloc as users do; CUDA: torch.cuda.max_memory_allocated,
in the same process as the timing), "extra" = peak
minus the unavoidable gradient outputs, and GB/s of compulsory traffic (fwd: logits read once; bwd: logits read + grad
written; both: 3x logits). On CUDA also the device-to-device copy bandwidth (read + write).
Writes results.csv, results.json and results.png into --out.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import socket
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks._timing import pct, positive_float, positive_int, results_dir  # noqa: E402

MODES = ("fwd", "bwd", "both")
OPS = ("logits", "fused_linear")
DTYPES = ("float32", "bfloat16", "float16")
MMAP_THRESHOLD = str(64 * 1024)     # bytes: every tensor of note gets its own mapping (CPU peaks)


def case_env() -> dict:
    """The environment of a case's memory subprocess: this repository importable, and glibc's
    mmap threshold fixed (unless set already) so the CPU peak RSS is the live tensors' peak."""
    return {**os.environ, "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_",
                                                                   MMAP_THRESHOLD),
            "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def time_env() -> dict:
    """The environment of a case's timing subprocess on CPU: this repository importable and
    malloc as users run it (glibc's own dynamic mmap threshold, unless the caller set one): a
    fixed 64 KiB threshold maps and faults in every chunk a chunked implementation allocates,
    which is no cost of the implementation."""
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


# ---------------------------------------------------------------------------------------------
# memory probes
# ---------------------------------------------------------------------------------------------
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


class Mem:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def reset(self) -> int:
        """Reset the peak; return current usage in bytes."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        with open("/proc/self/clear_refs", "w") as f:   # "5": reset VmHWM to the current RSS
            f.write("5")
        return _status_kb("VmRSS") * 1024

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return _status_kb("VmHWM") * 1024


# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------
def _segment_mean(values, cu):
    from hacpo.kernels.logprobs import segment_mean
    return segment_mean(values, cu)


def make_case(op, impl, shape, dtype, device, temperature):
    """Returns (inputs: dict of leaf tensors, run(inputs) -> output, fresh(inputs) -> inputs)."""
    g = torch.Generator(device=device).manual_seed(0)
    T = shape["T"]
    targets = torch.randint(0, shape["V"], (T,), device=device, generator=g)
    if op == "logits":
        V = shape["V"]
        logits = torch.empty(T, V, device=device, dtype=dtype).normal_(generator=g)
        n_seq = max(1, T // 512)
        cu = torch.linspace(0, T, n_seq + 1, device=device).long()
        inputs = {"logits": logits.requires_grad_()}
        if impl == "naive":
            def run(inp):
                lp = torch.log_softmax(inp["logits"].float() / temperature, -1)
                return _segment_mean(lp.gather(1, targets[:, None]).squeeze(1), cu)
        elif impl in ("torch", "triton"):
            from hacpo.kernels import sequence_mean_logprobs

            def run(inp):
                return sequence_mean_logprobs(inp["logits"], targets, cu, temperature=temperature,
                                              backend=impl)
        elif impl == "liger":
            from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

            def run(inp):
                x = inp["logits"] / temperature if temperature != 1.0 else inp["logits"]
                loss = LigerCrossEntropyFunction.apply(x, targets, None, -100, 0.0, 0.0, "none")
                return _segment_mean(-loss[0] if isinstance(loss, tuple) else -loss, cu)
        else:
            raise ValueError(impl)
    else:
        H, V = shape["H"], shape["V"]
        hidden = torch.empty(T, H, device=device, dtype=dtype).normal_(generator=g)
        weight = torch.empty(V, H, device=device, dtype=dtype).normal_(generator=g).mul_(H ** -0.5)
        inputs = {"hidden": hidden.requires_grad_(), "weight": weight.requires_grad_()}
        if impl == "naive":
            def run(inp):
                logits = (inp["hidden"] @ inp["weight"].t()).float() / temperature
                return torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
        elif impl in ("torch", "triton"):
            from hacpo.kernels import fused_linear_token_logprobs

            def run(inp):
                return fused_linear_token_logprobs(inp["hidden"], inp["weight"], targets,
                                                   temperature=temperature, backend=impl)
        elif impl == "liger":
            from liger_kernel.chunked_loss.fused_linear_ppo import \
                _ChunkedSelectiveLogProbFunction as F

            def run(inp):
                return F.apply(inp["hidden"], inp["weight"], targets, None, temperature, 4096)
        else:
            raise ValueError(impl)

    def fresh(inp):
        if impl == "liger" and op == "logits":   # liger overwrites the logits with their grad
            return {"logits": inp["logits"].detach().clone().requires_grad_()}
        for v in inp.values():
            v.grad = None
        return inp
    return inputs, run, fresh


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def worker(spec: dict) -> dict:
    """One (op, impl, mode) in a fresh process; ``spec["measure"]``: "memory" (the peak),
    "time" (warmup and timed repetitions) or "both" (memory first, so no earlier run has left
    freed memory resident in the allocator; the default, used on CUDA, where host malloc
    plays no part)."""
    measure = spec.get("measure", "both")
    if measure not in ("memory", "time", "both"):
        raise ValueError(f"measure must be memory, time or both, got {measure!r}")
    device = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    mode = spec["mode"]
    # load code paths and lazy state on a tiny problem first, so the peak below is the op's own
    tiny = {k: min(v, 64) for k, v in spec["shape"].items()}
    t_inputs, t_run, t_fresh = make_case(spec["op"], spec["impl"], tiny, dtype, device,
                                         spec["temperature"])
    y = t_run(t_fresh(t_inputs))
    y.backward(torch.ones_like(y))
    del y, t_inputs
    inputs, run, fresh = make_case(spec["op"], spec["impl"], spec["shape"], dtype, device,
                                   spec["temperature"])
    mem = Mem(device)
    grad_bytes = sum(v.numel() * v.element_size() for v in inputs.values())

    out = {"malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}
    if measure != "time":
        inp = fresh(inputs)
        if mode == "bwd":
            y = run(inp)
            base = mem.reset()
            y.backward(torch.ones_like(y))
        else:
            base = mem.reset()
            y = run(inp)
            if mode == "both":
                y.backward(torch.ones_like(y))
        peak = mem.peak() - base
        del y
        out.update(peak_bytes=peak, extra_bytes=peak - (grad_bytes if mode != "fwd" else 0))
    if measure == "memory":
        return out

    times = []
    for rep in range(spec["warmup"] + spec["reps"]):
        inp = fresh(inputs)
        _sync(device)
        t0 = time.perf_counter()
        y = run(inp)
        _sync(device)
        t1 = time.perf_counter()
        if mode != "fwd":
            y.backward(torch.ones_like(y))
            _sync(device)
        t2 = time.perf_counter()
        if rep >= spec["warmup"]:
            times.append({"fwd": t1 - t0, "bwd": t2 - t1, "both": t2 - t0}[mode])
        del y
    out.update(p20=pct(times, 0.2), p50=pct(times, 0.5), p80=pct(times, 0.8))
    return out


def run_case(spec: dict, env: dict, timeout: float | None) -> tuple[dict | None, str | None]:
    """``worker(spec)`` in a fresh subprocess with ``env``: (its result, None) or (None, why
    not)."""
    try:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
            capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"over --case-timeout {timeout}s"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        return None, f"failed (rc={proc.returncode}): {proc.stderr.strip()[-400:]}"
    return json.loads(line[0][len("RESULT "):]), None


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------
def copy_bandwidth(device) -> float | None:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written)."""
    if device.type != "cuda":
        return None
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    ts.sort()
    return 2 * n / ts[len(ts) // 2] / 1e9


def environment(device) -> dict:
    env = {"host": socket.gethostname(), "platform": platform.platform(),
           "python": platform.python_version(), "torch": torch.__version__,
           "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next(line.split(":", 1)[1].strip() for line in f
                              if line.startswith("model name"))
    except (OSError, StopIteration):
        env["cpu"] = platform.processor()
    from importlib import metadata
    for mod, dist_name in (("triton", "triton"), ("liger_kernel", "liger-kernel")):
        try:
            env[mod] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            env[mod] = "not installed"
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def available(impl, device) -> str | None:
    """None if the impl can run here, else the reason it is skipped."""
    import importlib.util
    if impl == "triton" and device.type != "cuda":
        return "Triton kernels need CUDA (the interpreter is ~100x slower: not a benchmark)"
    if impl == "liger":
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger_kernel not installed"
    return None


def op_list(text: str) -> list[str]:
    """argparse ``type=`` of ``--ops``: comma-separated names from ``OPS``."""
    ops = text.split(",")
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown op(s) {unknown}; from {', '.join(OPS)}")
    return ops


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    ap.add_argument("--device", choices=("cpu", "cuda"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=positive_int, default=None)
    ap.add_argument("--dtype", choices=DTYPES, default=None,
                    help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--ops", type=op_list, default=list(OPS), help="comma-separated")
    ap.add_argument("--case-timeout", type=positive_float, default=None,
                    help="seconds per (op, impl, mode) subprocess; a case over it is skipped")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.quick:
        shapes = {"logits": {"T": 512, "V": 8192}, "fused_linear": {"T": 512, "H": 256, "V": 8192}}
    elif cuda:
        shapes = {"logits": {"T": 16384, "V": 151936},
                  "fused_linear": {"T": 16384, "H": 4096, "V": 151936}}
    else:
        shapes = {"logits": {"T": 4096, "V": 65536},
                  "fused_linear": {"T": 4096, "H": 1024, "V": 65536}}
    reps = args.reps if args.reps is not None else (5 if args.quick else (20 if cuda else 5))
    name = (torch.cuda.get_device_name(device) if cuda else socket.gethostname()).replace(" ", "_")
    out_dir = args.out or os.path.join(ROOT, "benchmarks", "results", name)
    results_dir(ap, out_dir)

    env = environment(device)
    env["copy_GBps"] = copy_bandwidth(device)
    env["malloc_mmap_threshold"] = case_env()["MALLOC_MMAP_THRESHOLD_"]
    # CPU timing runs: glibc's default (dynamic) threshold unless the caller set one
    env["timing_malloc_mmap_threshold"] = (time_env().get("MALLOC_MMAP_THRESHOLD_") if not cuda
                                           else env["malloc_mmap_threshold"])
    print(json.dumps(env, indent=1))
    rows, skipped = [], []
    impls = ("naive", "torch", "triton", "liger")
    for op in args.ops:
        for impl in impls:
            why = available(impl, device)
            if op == "logits" and impl == "liger" and not cuda:
                why = why or "Liger's cross_entropy is a Triton kernel: CUDA only"
            if why:
                skipped.append({"op": op, "impl": impl, "reason": why})
                print(f"skip {op}/{impl}: {why}")
                continue
            s = shapes[op]
            esize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
            logit_bytes = s["T"] * s["V"] * esize
            for mode in MODES:
                spec = {"op": op, "impl": impl, "mode": mode, "shape": s, "dtype": dtype,
                        "device": args.device, "temperature": 1.0, "reps": reps,
                        "warmup": 1 if not cuda else 3}
                # CPU: the peak with the fixed mmap threshold, the time with malloc as users
                # run it, in two fresh processes; CUDA: both in one (host malloc plays no part)
                passes = ([("memory", case_env()), ("time", time_env())] if not cuda
                          else [("both", case_env())])
                r, reason = {}, None
                for measure, penv in passes:
                    got, reason = run_case({**spec, "measure": measure}, penv,
                                           args.case_timeout)
                    if got is None:
                        reason = f"{measure} pass {reason}"
                        break
                    if measure == "time":
                        got["timing_malloc_mmap_threshold"] = got.pop("malloc_mmap_threshold")
                    r.update(got)
                if reason:
                    skipped.append({"op": op, "impl": impl, "mode": mode, "reason": reason})
                    print(f"skip {op}/{impl}/{mode}: {reason}")
                    continue
                traffic = {"fwd": 1, "bwd": 2, "both": 3}[mode] * logit_bytes
                row = {"op": op, "impl": impl, "mode": mode, "dtype": dtype,
                       "shape": "x".join(f"{k}={v}" for k, v in s.items()),
                       "p20_ms": 1e3 * r["p20"], "p50_ms": 1e3 * r["p50"],
                       "p80_ms": 1e3 * r["p80"], "peak_MB": r["peak_bytes"] / 2 ** 20,
                       "extra_MB": r["extra_bytes"] / 2 ** 20,
                       "GBps": (traffic / r["p50"] / 1e9) if op == "logits" else None,
                       "malloc_mmap_threshold": r["malloc_mmap_threshold"],
                       "timing_malloc_mmap_threshold": r.get("timing_malloc_mmap_threshold",
                                                             r["malloc_mmap_threshold"])}
                if env["copy_GBps"] and row["GBps"]:
                    row["frac_of_copy_bw"] = row["GBps"] / env["copy_GBps"]
                rows.append(row)
                gbps = f"{row['GBps']:8.1f}" if row["GBps"] else "     n/a"
                print(f"{op:13s} {impl:7s} {mode:5s} p20/p50/p80 {row['p20_ms']:9.1f} "
                      f"{row['p50_ms']:9.1f} {row['p80_ms']:9.1f} ms  peak {row['peak_MB']:9.1f}"
                      f" MB  extra {row['extra_MB']:9.1f} MB  GB/s {gbps}", flush=True)

    summary = summarize(rows)
    for line in summary:
        print(line)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"environment": env, "shapes": shapes, "reps": reps, "rows": rows,
                   "skipped": skipped, "summary": summary}, f, indent=1)
    keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k)
                  if k in rows[0] else 99)
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    png = os.path.join(out_dir, "results.png")
    if os.path.exists(png):     # an earlier run's plot: not of the results written now
        os.remove(png)
    if rows:
        plot(rows, png, env)
        print(f"wrote {out_dir}/results.{{csv,json,png}}")
        return 0
    print(f"no case ran (see skipped): wrote {out_dir}/results.{{csv,json}}, no plot")
    return 1


def summarize(rows) -> list[str]:
    """Ratios against naive for the issue's targets."""
    by = {(r["op"], r["impl"], r["mode"]): r for r in rows}
    lines = []
    for op in ("logits", "fused_linear"):
        for impl in ("torch", "triton", "liger"):
            for mode in MODES:
                a, n = by.get((op, impl, mode)), by.get((op, "naive", mode))
                if not a or not n:
                    continue
                mem = a["extra_MB"] / n["extra_MB"] if n["extra_MB"] > 0 else float("nan")
                lines.append(f"{op}/{impl}/{mode}: time {a['p50_ms'] / n['p50_ms']:.2f}x naive, "
                             f"extra memory {mem:.3f}x naive "
                             f"({a['extra_MB']:.0f} vs {n['extra_MB']:.0f} MB)")
    return lines


def plot(rows, path, env):
    from hacpo.engine.plots import subplots    # not pyplot: main() also runs in a test process
    ops = sorted({r["op"] for r in rows})
    try:
        fig, axes = subplots(len(ops), 2, figsize=(12, 4 * len(ops)), squeeze=False)
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    for i, op in enumerate(ops):
        impls = [m for m in ("naive", "torch", "triton", "liger")
                 if any(r["op"] == op and r["impl"] == m for r in rows)]
        for j, (key, label) in enumerate((("p50_ms", "p50 time (ms)"),
                                          ("extra_MB", "peak extra memory (MB)"))):
            ax = axes[i][j]
            width = 0.8 / max(1, len(impls))
            for k, impl in enumerate(impls):
                vals = [next((r[key] for r in rows if r["op"] == op and r["impl"] == impl
                              and r["mode"] == m), 0) for m in MODES]
                ax.bar([x + k * width for x in range(len(MODES))], vals, width, label=impl)
            ax.set_xticks([x + width * (len(impls) - 1) / 2 for x in range(len(MODES))])
            ax.set_xticklabels(MODES)
            ax.set_title(f"{op}: {label}")
            ax.legend()
    fig.suptitle(f"{env.get('gpu', env.get('cpu'))} | torch {env['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
