"""A megatron-core policy's scoring and training step with ``lm_head="logits"`` (megatron's
output layer over every position, then the vocab-parallel log-softmax of the response rows)
against ``lm_head="fused"`` (the final hidden states of the response rows only, through
``hacpo.kernels.fused_linear_token_logprobs`` with the TP group: no logits tensor), measured
side by side in one run.

    PYTHONPATH=. python benchmarks/bench_megatron_lm_head.py RESULTS_DIR [--tp 1] [--pp 1]
        [--hidden 512 --ffn 1408 --layers 2 --heads 8 --kv-heads 2 --vocab 65536]
        [--rows 4 --prompt 256 --response-min 128 --response-max 512] [--reps 3]

CPU only: tp*pp gloo processes with megatron-core's CUDA calls mapped to CPU by the *test-only*
helper ``tests/megatron/_cpu_megatron.py`` (as ``bench_weight_pull.py``; library code never
patches megatron). Each mode runs in fresh processes. A rank builds the HF model (Llama,
untied, fp32, seed 0) and its megatron shard with an SGD optimizer (no optimizer state, so the
memory is the step's own), then on one batch (``--rows`` rows: a prompt of ``--prompt``
tokens and responses of lengths spread over [response-min, response-max], right-padded;
the response tokens are scored, as the trainer does):

- ``score``: ``token_logprobs(..., positions, mask)`` (forward only, the old log-probs),
- ``step``: one ``train_step`` whose loss is a token-level surrogate over the response tokens
  (forward, backward, the SGD step),

one warm-up call each, then ``--reps`` timed calls each; memory is the peak resident memory
above the level just before the call (VmHWM, reset through ``/proc/self/clear_refs``), the
largest over the reps, per rank. Both modes must produce the same log-probs and, after the same
steps, the same weights (checked and printed). Writes RESULTS_DIR/lm_head.json and prints a
table.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks._megatron_bench import llama, reset_peak, status_kb  # noqa: E402

MODES = ("logits", "fused")


def make_batch(a):
    """ids / targets [B, S] (prompt + response, right-padded), the response tokens' positions
    and mask [B, R], per-row advantages."""
    B, P = a["rows"], a["prompt"]
    g = torch.Generator().manual_seed(1)
    lens = torch.linspace(a["response_min"], a["response_max"], B).round().long().tolist()
    S, R = P + max(lens), max(lens)
    ids = torch.zeros(B, S, dtype=torch.long)
    targets = torch.zeros(B, S, dtype=torch.long)
    pos = torch.zeros(B, R, dtype=torch.long)
    mask = torch.zeros(B, R, dtype=torch.bool)
    for i, n in enumerate(lens):
        seq = torch.randint(0, a["vocab"], (P + n,), generator=g)
        ids[i, :P + n] = seq
        targets[i, :P + n - 1] = seq[1:]
        pos[i, :n] = torch.arange(P - 1, P - 1 + n)
        mask[i, :n] = True
    adv = torch.randn(B, generator=g)
    return ids, targets, pos, mask, adv, lens


def _surrogate(lp, mb):
    """A token-level policy-gradient surrogate over the response tokens (global divisor)."""
    loss = -(lp * mb["adv"][:, None] * mb["positions_mask"]).sum() / mb["divisor"]
    return loss, {}


def _measure(fn):
    gc.collect()
    torch.distributed.barrier()
    base = status_kb("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    return out, seconds, (status_kb("VmHWM") - base) / 1024


def _worker(rank, world, a, mode, out_path):
    from hacpo.models.megatron import MegatronPolicy, init_parallel

    torch.set_num_threads(a["threads"])
    par = init_parallel(a["tp"], a["pp"])
    hf = llama(a, max_position_embeddings=a["prompt"] + a["response_max"])
    pol = MegatronPolicy.from_hf(hf, par, lm_head=mode)
    del hf
    opt = pol.build_optimizer(lr=1e-3, optimizer="sgd")
    ids, targets, pos, mask, adv, lens = make_batch(a)
    mb = {"input_ids": ids, "targets": targets, "positions": pos, "positions_mask": mask,
          "adv": adv, "divisor": mask.sum().float()}

    def score():
        return pol.token_logprobs(ids, targets, positions=pos, mask=mask)

    def step():
        return pol.train_step(opt, [mb], _surrogate)

    first_lp = score()                       # warm-up; the log-probs compared across modes
    step()                                   # warm-up (weights move: same in both modes)
    res = {}
    for name, fn in (("score", score), ("step", step)):
        times, peaks = [], []
        for _ in range(a["reps"]):
            _, s, p = _measure(fn)
            times.append(s)
            peaks.append(p)
        res[name] = {"seconds": times, "peak_mib": max(peaks)}
    weights = pol.hf_state_dict(everywhere=False)
    got = [None] * world
    torch.distributed.all_gather_object(got, res)
    if rank == 0:
        torch.save({"by_rank": got, "lp": first_lp, "weights": weights,
                    "scored_tokens": int(mask.sum()), "positions": int(ids.numel())}, out_path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results_dir")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response-min", type=int, default=128)
    p.add_argument("--response-max", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args(argv)
    if not os.path.exists("/proc/self/clear_refs"):
        p.error("needs Linux /proc (peak RSS reset through /proc/self/clear_refs)")
    if not 1 <= args.response_min <= args.response_max or args.reps < 1 or args.rows < 1:
        p.error("need 1 <= response-min <= response-max, reps >= 1, rows >= 1")
    # A fixed mmap threshold: large tensors get their own mappings and go back to the OS when
    # freed, so resident memory follows live tensors (see bench_weight_pull.py).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    from tests.megatron._cpu_megatron import spawn   # test-only CUDA->CPU patches

    a = {k: getattr(args, k) for k in ("tp", "pp", "hidden", "ffn", "layers", "heads",
                                       "kv_heads", "vocab", "rows", "prompt", "response_min",
                                       "response_max", "reps", "threads")}
    world = args.tp * args.pp
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            path = os.path.join(tmp, f"{mode}.pt")
            spawn(_worker, world, a, mode, path)
            runs[mode] = torch.load(path)
    ref, fused = runs["logits"], runs["fused"]
    lp_diff = float((fused["lp"] - ref["lp"]).abs().max())
    w_diff = max(float((fused["weights"][k] - ref["weights"][k]).abs().max())
                 for k in ref["weights"])
    # fp32 throughout: the same GEMM rows and log-softmax in another order; the SGD steps
    # (lr 1e-3) carry ~1e-6 log-prob differences into the weights at ~1e-9
    same = lp_diff < 1e-4 and w_diff < 1e-6 and ref["weights"].keys() == fused["weights"].keys()
    rows = []
    for mode in MODES:
        for name in ("score", "step"):
            by_rank = [r[name] for r in runs[mode]["by_rank"]]
            rows.append({"mode": mode, "call": name,
                         "seconds_p50_by_rank": [statistics.median(r["seconds"])
                                                 for r in by_rank],
                         "seconds_by_rank": [r["seconds"] for r in by_rank],
                         "peak_mib_by_rank": [r["peak_mib"] for r in by_rank]})
    ratios = {}
    for name in ("score", "step"):
        r0 = next(r for r in rows if r["mode"] == "logits" and r["call"] == name)
        r1 = next(r for r in rows if r["mode"] == "fused" and r["call"] == name)
        ratios[name] = {"time_fused_over_logits": max(r1["seconds_p50_by_rank"]) /
                        max(r0["seconds_p50_by_rank"]),
                        "peak_fused_over_logits": max(r1["peak_mib_by_rank"]) /
                        max(r0["peak_mib_by_rank"])}
    B, P = args.rows, args.prompt
    S = P + args.response_max
    out = {"layout": a, "device": "cpu", "torch": torch.__version__,
           "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "malloc_mmap_threshold": os.environ["MALLOC_MMAP_THRESHOLD_"],
           "scored_tokens": ref["scored_tokens"], "positions": ref["positions"],
           "logits_mib_per_rank": B * S * args.vocab / args.tp * 4 / 2 ** 20,
           "max_abs_logprob_diff": lp_diff, "max_abs_weight_diff_after_steps": w_diff,
           "same_results": same, "rows": rows, "ratios": ratios}
    os.makedirs(args.results_dir, exist_ok=True)
    with open(os.path.join(args.results_dir, "lm_head.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"tp={args.tp} pp={args.pp}, {B} rows x {S} positions, {ref['scored_tokens']} scored "
          f"response tokens, V={args.vocab}, H={args.hidden} (fp32 logits of every position: "
          f"{out['logits_mib_per_rank']:.0f} MiB per TP rank)")
    print(f"{'mode':>7} {'call':>6} {'p50 s (slowest rank)':>21} {'peak MiB (max rank)':>20}")
    for r in rows:
        print(f"{r['mode']:>7} {r['call']:>6} {max(r['seconds_p50_by_rank']):>21.3f} "
              f"{max(r['peak_mib_by_rank']):>20.1f}")
    for name, q in ratios.items():
        print(f"fused / logits, {name}: time {q['time_fused_over_logits']:.2f}x, peak memory "
              f"{q['peak_fused_over_logits']:.3f}x")
    print(f"same results: {same} (log-probs {lp_diff:.2e}, weights after the steps "
          f"{w_diff:.2e})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
