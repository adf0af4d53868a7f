"""Optimizer memory of a megatron-core DP group: megatron's plain optimizer (every DP rank holds
the Adam state of every parameter) against its distributed optimizer (ZeRO-1,
``parallel.distributed_optimizer``: each DP rank holds the state of a 1/dp slice, gradients
reduce-scattered, the updated slices all-gathered), measured side by side in one run on the
same RL-like rows.

    PYTHONPATH=. python benchmarks/bench_megatron_optimizer.py RESULTS_DIR [--dp 2] [--tp 1]
        [--pp 1] [--hidden 1024 --ffn 2816 --layers 4 --heads 16 --kv-heads 4 --vocab 32768]
        [--prompts 2 --group 4 --prompt-min 32 --prompt-max 128 --response-mean 64
         --response-max 256] [--micro-batch 2] [--reps 2]

CPU only: tp*pp*dp gloo processes with megatron-core's CUDA calls mapped to CPU by the
*test-only* helper ``tests/megatron/_cpu_megatron.py`` (as the other megatron benchmarks;
library code never patches megatron). Each mode runs in fresh processes; ``plain`` is the
baseline of the ratios. The rows are bench_megatron_micro_batches.py's, cut into micro-batches
of ``--micro-batch`` rows ordered by prompt and dealt to the DP ranks in turn; the loss is the
token-level surrogate with the whole batch's divisor; the optimizer is Adam (lr 1e-4), fp32.

Per mode and rank: ``adam_state_mib``: the Adam moments the rank's optimizer holds (exact, from
its tensors); ``resident_mib``: the rank's resident memory after the first step above its
level before any model was built (weights, the DDP gradient buffer, the optimizer state,
allocator overhead); then ``score`` (the old
log-probs, forward only) and ``step`` (forward, backward, optimizer step): one warm-up call
each, ``--reps`` timed calls, p50 time and peak resident memory above the level before the
call (VmHWM reset through ``/proc/self/clear_refs``). Both modes must end with the same
weights and log-probs (checked and printed). Writes RESULTS_DIR/optimizer.json and prints a
table. On CPU gloo's reduce-scatter / all-gather cost more relative to compute than NCCL's on
GPUs: the memory ratios are the point, the time ratio says little about GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks._megatron_bench import (add_model_args, call_rows, compare_runs,  # noqa: E402
                                        environment, llama, mode_ratios, ratio, run_modes,
                                        status_kb, surrogate, time_calls)
from benchmarks._timing import results_dir  # noqa: E402
from benchmarks.bench_megatron_micro_batches import (add_row_args, check_row_args,  # noqa: E402
                                                     make_rows, pack, plan, step_micro_batches)

MODES = ("plain", "distributed")


def adam_state_bytes(opt) -> int:
    """Bytes of the Adam moments (exp_avg, exp_avg_sq) held by a megatron optimizer."""
    from hacpo.models.megatron.policy import chained

    return sum(t.numel() * t.element_size()
               for o in chained(opt)
               for st in o.optimizer.state.values() for k, t in st.items()
               if k in ("exp_avg", "exp_avg_sq"))


def _worker(rank, world, a, mode, out_path):
    import torch.distributed as dist

    from hacpo.models.megatron import MegatronPolicy, init_parallel
    from hacpo.models.megatron.policy import chained

    torch.set_num_threads(a["threads"])
    base_kb = status_kb("VmRSS")     # the process before any model (torch, megatron imported)
    par = init_parallel(a["tp"], a["pp"], a["dp"])
    prompts, resps, adv = make_rows(a)
    hf = llama(a, max_position_embeddings=max(len(p) + len(r) for p, r in zip(prompts, resps)))
    pol = MegatronPolicy.from_hf(hf, par)
    del hf
    opt = pol.build_optimizer(lr=1e-4, optimizer="adam",
                              use_distributed_optimizer=mode == "distributed")
    packed = ids, targets, pos, mask = pack(prompts, resps)
    groups = plan(a, prompts, resps, "rows")[par.dp_rank::par.dp]     # this DP rank's share
    mbs = step_micro_batches(packed, prompts, resps, adv, groups)

    def score():
        return pol.token_logprobs(ids, targets, positions=pos, mask=mask,
                                  micro_batch_size=a["micro_batch"])

    def step():
        return pol.train_step(opt, mbs, surrogate)

    step()                           # the first step allocates the Adam state
    import gc
    gc.collect()
    mine = {"adam_state_mib": adam_state_bytes(opt) / 2**20,
            "resident_mib": (status_kb("VmRSS") - base_kb) / 1024,
            "optimizer": "+".join(type(o).__name__ for o in chained(opt))}
    every = [None] * world
    dist.all_gather_object(every, mine)
    time_calls(rank, world, pol, score, step, a["reps"], out_path, memory_by_rank=every)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results_dir")
    add_model_args(p, hidden=1024, ffn=2816, layers=4, heads=16, kv_heads=4)
    p.add_argument("--dp", type=int, default=2)
    add_row_args(p, prompts=2, response_mean=64.0, response_max=256)
    p.set_defaults(micro_batch=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args(argv)
    if not os.path.exists("/proc/self/clear_refs"):
        p.error("needs Linux /proc (peak RSS reset through /proc/self/clear_refs)")
    check_row_args(p, args)
    n_groups = -(-args.prompts * args.group // args.micro_batch)
    if args.dp < 2 or n_groups < args.dp:
        p.error(f"needs --dp >= 2 and at least one micro-batch per DP rank (got dp={args.dp}, "
                f"{n_groups} micro-batches)")

    results_dir(p, args.results_dir)
    a = {k: getattr(args, k) for k in ("tp", "pp", "dp", "hidden", "ffn", "layers", "heads",
                                       "kv_heads", "vocab", "prompts", "group", "prompt_min",
                                       "prompt_max", "response_mean", "response_max",
                                       "micro_batch", "reps", "threads")}
    prompts, resps, _ = make_rows(a)
    lens = [len(q) + len(r) for q, r in zip(prompts, resps)]
    runs = run_modes(_worker, args.tp * args.pp * args.dp, a, MODES)
    built = {m: {r["optimizer"] for r in runs[m]["memory_by_rank"]} for m in MODES}
    if built != {"plain": {"FP32Optimizer"}, "distributed": {"DistributedOptimizer"}}:
        raise RuntimeError(f"the ranks built {built}")
    lp_diff, w_diff, same = compare_runs(runs["plain"], runs["distributed"])
    rows = call_rows(runs, MODES)
    memory = {m: {k: [r[k] for r in runs[m]["memory_by_rank"]]
                  for k in ("adam_state_mib", "resident_mib")} for m in MODES}
    ratios = {"distributed_over_plain": {
        "adam_state": ratio(max(memory["distributed"]["adam_state_mib"]),
                            max(memory["plain"]["adam_state_mib"])),
        "resident": ratio(max(memory["distributed"]["resident_mib"]),
                          max(memory["plain"]["resident_mib"])),
        **mode_ratios(rows, "plain", "distributed")}}
    n_params = sum(v.numel() for v in runs["plain"]["weights"].values())
    out = {"layout": a, **environment(), "parameters": n_params, "row_tokens": sum(lens),
           "response_tokens": sum(len(r) for r in resps), "memory_by_rank": memory,
           "max_abs_logprob_diff": lp_diff, "max_abs_weight_diff_after_steps": w_diff,
           "same_results": same, "rows": rows, "ratios": ratios}
    with open(os.path.join(args.results_dir, "optimizer.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"tp={args.tp} pp={args.pp} dp={args.dp}, {n_params / 1e6:.1f}M parameters (fp32, "
          f"Adam), {len(lens)} rows, {sum(lens)} tokens, V={args.vocab}, H={args.hidden}, "
          f"{args.layers} layers")
    print(f"{'mode':>12} {'Adam state MiB by rank':>24} {'resident MiB by rank':>24}")
    for m in MODES:
        print(f"{m:>12} {str([round(v, 1) for v in memory[m]['adam_state_mib']]):>24} "
              f"{str([round(v) for v in memory[m]['resident_mib']]):>24}")
    print(f"{'mode':>12} {'call':>6} {'p50 s (slowest rank)':>21} {'peak MiB (max rank)':>20}")
    for r in rows:
        print(f"{r['mode']:>12} {r['call']:>6} {max(r['seconds_p50_by_rank']):>21.3f} "
              f"{max(r['peak_mib_by_rank']):>20.1f}")
    q = ratios["distributed_over_plain"]
    print(f"distributed / plain: Adam state {q['adam_state']:.3f}x, resident memory "
          f"{q['resident']:.3f}x, step time {q['step']['time_distributed_over_plain']:.2f}x, "
          f"step peak {q['step']['peak_distributed_over_plain']:.3f}x")
    print(f"same results: {same} (log-probs {lp_diff:.2e}, weights after the steps "
          f"{w_diff:.2e})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
