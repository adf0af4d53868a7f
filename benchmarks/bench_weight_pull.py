"""Rank 0's memory and time for pulling a megatron-core policy's weights as HF tensors: whole
(``MegatronPolicy.hf_state_dict(everywhere=False)``) against bucketed
(``hf_state_of_units`` one bucket at a time, as ``MegatronAgents.pull_weights`` does with
``parallel.weight_bucket_mb``).

    PYTHONPATH=. python benchmarks/bench_weight_pull.py RESULTS_DIR [--tp 2] [--pp 1]
        [--hidden 1024 --ffn 2816 --layers 8 --heads 16 --kv-heads 4 --vocab 32000]
        [--buckets 256 128 64]

CPU only: tp*pp gloo processes with megatron-core's CUDA calls mapped to CPU by the *test-only*
helper ``tests/megatron/_cpu_megatron.py`` (as ``gpu_smoke.py --device cpu`` does; library
code never patches megatron). Each mode runs in fresh processes (memory freed by an earlier
mode would otherwise be reused unseen). A rank builds the HF model (Llama, untied, fp32, seed
0), its megatron shard, drops the HF model, then measures the pull: peak resident memory above
the level just before it (VmHWM, reset through ``/proc/self/clear_refs``), seconds, tensors and
bytes pulled. Every mode's pulled weights are checked against the whole pull's checksums.
Writes RESULTS_DIR/weight_pull.json and prints a table.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks._megatron_bench import (add_model_args, llama, reset_peak,  # noqa: E402
                                        status_kb)
from benchmarks._timing import positive_float, results_dir  # noqa: E402


def _worker(rank, world, a, bucket_mb, out_path):
    from hacpo.models.megatron import (MegatronPolicy, hf_units, init_parallel, plan_buckets,
                                       unit_of_hf_name)

    par = init_parallel(a["tp"], a["pp"])
    hf = llama(a)
    sizes: dict = {}
    for name, t in hf.state_dict().items():
        u = unit_of_hf_name(name)
        sizes[u] = sizes.get(u, 0) + t.numel() * t.element_size()
    pol = MegatronPolicy.from_hf(hf, par)
    units = hf_units(pol.arch)
    plan = ([units] if bucket_mb is None else
            plan_buckets([(u, sizes[u]) for u in units], max(1, int(bucket_mb * 2 ** 20))))
    del hf
    gc.collect()
    torch.distributed.barrier()
    base = status_kb("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    tensors, nbytes, sums = 0, 0, {}
    for bucket in plan:
        sd = pol.hf_state_of_units(bucket)
        if sd is not None:
            tensors += len(sd)
            nbytes += sum(t.numel() * t.element_size() for t in sd.values())
            sums.update({k: float(v.double().sum()) for k, v in sd.items()})
        del sd
    seconds = time.perf_counter() - t0
    peak = status_kb("VmHWM") - base
    got = [None] * world
    torch.distributed.all_gather_object(got, {"rank": rank, "peak_mib": peak / 1024})
    if rank == 0:
        torch.save({"buckets": len(plan), "seconds": seconds, "tensors": tensors,
                    "pulled_mib": nbytes / 2 ** 20, "checksums": sums,
                    "peak_mib_by_rank": [g["peak_mib"] for g in got],
                    "largest_unit_mib": max(sizes.values()) / 2 ** 20,
                    "model_mib": sum(sizes.values()) / 2 ** 20}, out_path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results_dir")
    add_model_args(p, tp=2, hidden=1024, ffn=2816, layers=8, heads=16, kv_heads=4, vocab=32000)
    p.add_argument("--buckets", type=positive_float, nargs="+", default=[256.0, 128.0, 64.0],
                   help="bucket sizes in MiB (parallel.weight_bucket_mb) to compare with the "
                        "whole pull")
    args = p.parse_args(argv)
    if not os.path.exists("/proc/self/clear_refs"):
        p.error("needs Linux /proc (peak RSS reset through /proc/self/clear_refs)")
    results_dir(p, args.results_dir)
    # A fixed mmap threshold: every large tensor gets its own mapping and goes back to the OS
    # when freed, so resident memory follows live tensors (glibc's dynamic threshold would
    # keep freed tensors in the heap, and the peak would depend on the allocation history).
    # The rank processes inherit it (spawned after this).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    from tests.megatron._cpu_megatron import spawn   # test-only CUDA->CPU patches

    a = {"tp": args.tp, "pp": args.pp, "hidden": args.hidden, "ffn": args.ffn,
         "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
         "vocab": args.vocab}
    world = args.tp * args.pp
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mb in [None, *args.buckets]:
            path = os.path.join(tmp, f"{mb}.pt")
            spawn(_worker, world, a, mb, path)
            r = torch.load(path)
            rows.append({"mode": "whole" if mb is None else f"{mb:g} MiB buckets",
                         "bucket_mb": mb, **r})
    ref = rows[0]["checksums"]          # the whole pull's per-tensor sums
    for r in rows:
        r["same_weights_as_whole"] = r["checksums"] == ref
    for r in rows:
        del r["checksums"]
    out = {"layout": a, "device": "cpu", "torch": torch.__version__,
           "malloc_mmap_threshold": os.environ["MALLOC_MMAP_THRESHOLD_"], "rows": rows}
    with open(os.path.join(args.results_dir, "weight_pull.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"model {rows[0]['model_mib']:.1f} MiB (largest unit {rows[0]['largest_unit_mib']:.1f}"
          f" MiB), tp={args.tp} pp={args.pp}; rank 0's peak memory above its level before "
          f"the pull:")
    print(f"{'mode':>18} {'buckets':>8} {'rank0 peak MiB':>15} {'others MiB':>11} "
          f"{'seconds':>8} {'same':>5}")
    for r in rows:
        others = max(r["peak_mib_by_rank"][1:], default=0.0)
        print(f"{r['mode']:>18} {r['buckets']:>8} {r['peak_mib_by_rank'][0]:>15.1f} "
              f"{others:>11.1f} {r['seconds']:>8.2f} {str(r['same_weights_as_whole']):>5}")
    return 0 if all(r["same_weights_as_whole"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
