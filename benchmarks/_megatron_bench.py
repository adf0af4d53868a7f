"""Shared by the megatron CPU benchmarks (bench_weight_pull.py, bench_megatron_lm_head.py,
bench_megatron_micro_batches.py): peak resident memory probes, their random HF Llama, and the
two-mode score / step measurement and comparison."""
from __future__ import annotations

import torch


def status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Reset VmHWM (the peak resident memory) to the current resident memory."""
    with open("/proc/self/clear_refs", "w") as f:   # "5": reset the peak RSS (VmHWM)
        f.write("5")


def llama(a: dict, **config):
    """A random untied HF Llama (seed 0, fp32, eval) of ``a``'s hidden / ffn / layers / heads /
    kv_heads / vocab; ``config``: further LlamaConfig fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=a["hidden"], intermediate_size=a["ffn"],
                      num_hidden_layers=a["layers"], num_attention_heads=a["heads"],
                      num_key_value_heads=a["kv_heads"], vocab_size=a["vocab"],
                      tie_word_embeddings=False, **config)
    return LlamaForCausalLM(cfg).eval()


def surrogate(lp, mb):
    """A token-level policy-gradient surrogate over the response tokens (global divisor):
    ``mb`` holds ``adv`` [b], ``positions_mask`` [b, T] and ``divisor``."""
    loss = -(lp * mb["adv"][:, None] * mb["positions_mask"]).sum() / mb["divisor"]
    return loss, {}


def measure(fn):
    """(fn(), seconds, peak resident MiB above the level before the call), all ranks in step."""
    import gc
    import time

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    base = status_kb("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    return out, seconds, (status_kb("VmHWM") - base) / 1024


def time_calls(rank: int, world: int, pol, score, step, reps: int, out_path: str,
               **extra) -> None:
    """A megatron benchmark worker's measurements: one warm-up call of ``score`` (its
    log-probs kept for the comparison across modes) and of ``step``, then ``reps`` timed calls
    of each, then ``score`` once more; rank 0 saves {"by_rank": every rank's {"score"/"step":
    {"seconds", "peak_mib"}}, "lp", "lp_after" (the log-probs after the steps), "weights" (HF
    names, after the steps), **extra} to ``out_path``."""
    import torch.distributed as dist

    first_lp = score()
    step()                       # warm-up (weights move: the same in every mode)
    res = {}
    for name, fn in (("score", score), ("step", step)):
        times, peaks = [], []
        for _ in range(reps):
            _, s, p = measure(fn)
            times.append(s)
            peaks.append(p)
        res[name] = {"seconds": times, "peak_mib": max(peaks)}
    lp_after = score()
    weights = pol.hf_state_dict(everywhere=False)
    got = [None] * world
    dist.all_gather_object(got, res)
    if rank == 0:
        torch.save({"by_rank": got, "lp": first_lp, "lp_after": lp_after, "weights": weights,
                    **extra}, out_path)


def compare_runs(ref: dict, other: dict) -> tuple[float, float, bool]:
    """Largest log-prob (before and after the steps) and weight differences between two modes'
    runs, and whether they count as the same results: fp32 throughout, the same rows through
    other GEMM shapes or reduction orders (~1e-6 in a log-prob), carried by the steps (SGD lr
    1e-3, Adam lr 1e-4) into the weights at ~1e-9. Raises if the steps left the reference's
    log-probs unchanged (equal weights would then prove nothing)."""
    moved = float((ref["lp_after"] - ref["lp"]).abs().max())
    if not moved > 1e-7:
        raise RuntimeError(f"the steps did not change the log-probs ({moved:.1e}): the "
                           f"comparison of the weights after them would prove nothing")
    lp = max(float((other[k] - ref[k]).abs().max()) for k in ("lp", "lp_after"))
    w = max(float((other["weights"][k] - ref["weights"][k]).abs().max())
            for k in ref["weights"])
    return lp, w, lp < 1e-4 and w < 1e-6 and ref["weights"].keys() == other["weights"].keys()


def call_rows(runs: dict, modes, **extra_of) -> list[dict]:
    """One row per (mode, call) with p50 time and peak memory per rank; ``extra_of``:
    name -> fn(mode, call) for further columns."""
    from benchmarks._timing import pct

    rows = []
    for mode in modes:
        for call in ("score", "step"):
            by_rank = [r[call] for r in runs[mode]["by_rank"]]
            rows.append({"mode": mode, "call": call,
                         **{k: f(mode, call) for k, f in extra_of.items()},
                         "seconds_p50_by_rank": [pct(r["seconds"], 0.5)
                                                 for r in by_rank],
                         "seconds_by_rank": [r["seconds"] for r in by_rank],
                         "peak_mib_by_rank": [r["peak_mib"] for r in by_rank]})
    return rows


def ratio(a: float, b: float) -> float:
    """a / b, nan where b is 0."""
    return a / b if b else float("nan")


def mode_ratios(rows: list[dict], base: str, mode: str) -> dict:
    """{call: {"time_<mode>_over_<base>", "peak_<mode>_over_<base>"}} of the slowest rank's
    p50 time and the largest rank peak (nan where the base is 0: at tiny sizes a call may
    add no resident page)."""
    out = {}
    for call in ("score", "step"):
        r0 = next(r for r in rows if r["mode"] == base and r["call"] == call)
        r1 = next(r for r in rows if r["mode"] == mode and r["call"] == call)
        out[call] = {f"time_{mode}_over_{base}": ratio(max(r1["seconds_p50_by_rank"]),
                                                       max(r0["seconds_p50_by_rank"])),
                     f"peak_{mode}_over_{base}": ratio(max(r1["peak_mib_by_rank"]),
                                                       max(r0["peak_mib_by_rank"]))}
    return out


MODEL_ARGS = {"tp": 1, "pp": 1, "hidden": 512, "ffn": 1408, "layers": 2, "heads": 8,
              "kv_heads": 2, "vocab": 32768}


def add_model_args(p, **defaults: int) -> None:
    """The layout and model flags every megatron CPU benchmark takes (Llama, untied, fp32):
    ``--tp --pp --hidden --ffn --layers --heads --kv-heads --vocab``, defaults ``MODEL_ARGS``
    updated by ``defaults``; each must be >= 1 (0 was a misleading FileNotFoundError or a
    ZeroDivisionError from the rank processes)."""
    from benchmarks._timing import positive_int

    unknown = set(defaults) - set(MODEL_ARGS)
    if unknown:
        raise ValueError(f"no model flag(s) {sorted(unknown)}")
    for name, v in {**MODEL_ARGS, **defaults}.items():
        p.add_argument("--" + name.replace("_", "-"), type=positive_int, default=v)


def run_modes(worker, world: int, a: dict, modes) -> dict:
    """Each mode in fresh gloo processes (``worker(rank, world, a, mode, out_path)``, the test
    helper's CPU patches applied), after fixing the malloc mmap threshold: large tensors get
    their own mappings and go back to the OS when freed, so resident memory follows live
    tensors (see bench_weight_pull.py). Returns {mode: what its rank 0 saved}."""
    import os
    import tempfile

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    from tests.megatron._cpu_megatron import spawn   # test-only CUDA->CPU patches

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            path = os.path.join(tmp, f"{mode}.pt")
            spawn(worker, world, a, mode, path)
            runs[mode] = torch.load(path)
    return runs


def environment() -> dict:
    """What the results were measured with."""
    import os
    import platform

    return {"device": "cpu", "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}
