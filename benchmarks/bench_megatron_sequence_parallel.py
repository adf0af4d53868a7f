"""A megatron-core TP policy's scoring and training step without and with megatron's sequence
parallelism (``parallel.sequence_parallel``: norms and residuals hold S/tp positions per TP rank,
all-gathers / reduce-scatters instead of all-reduces; hacpo/models/megatron/build.py), measured
side by side in one run on the same RL-like rows.

    PYTHONPATH=. python benchmarks/bench_megatron_sequence_parallel.py RESULTS_DIR [--tp 2]
        [--pp 1] [--hidden 1024 --ffn 2816 --layers 4 --heads 16 --kv-heads 4 --vocab 32768]
        [--prompts 4 --group 4 --prompt-min 32 --prompt-max 128 --response-mean 256
         --response-max 1024] [--micro-batch 4] [--reps 3]

CPU only: tp*pp gloo processes with megatron-core's CUDA calls mapped to CPU by the *test-only*
helper ``tests/megatron/_cpu_megatron.py`` (as the other megatron benchmarks; library code
never patches megatron). Each mode runs in fresh processes. The rows are those of
bench_megatron_micro_batches.py (``--group`` responses per prompt, exponential lengths), cut
into micro-batches of ``--micro-batch`` rows ordered by prompt (the trainer's default). Modes:
``tp`` (sequence_parallel off) and ``sp`` (on; each micro-batch padded to a multiple of tp).

Per mode: ``score`` = ``token_logprobs`` of the response tokens (forward only, the old
log-probs); ``step`` = one ``train_step`` with a token-level surrogate loss and the global
divisor (forward, backward, SGD). One warm-up call each, then ``--reps`` timed calls; memory
is the peak resident memory above the level before the call (VmHWM reset through
``/proc/self/clear_refs``), the largest over the reps, per rank. Both modes must give the same
log-probs and, after the same steps, the same weights (checked and printed). Writes
RESULTS_DIR/sequence_parallel.json and prints a table. On CPU, gloo's all-gather and
reduce-scatter are slower than its all-reduce relative to compute, so the time ratio here says
little about NCCL on GPUs; the memory ratio is the point.
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
                                        environment, llama, mode_ratios, run_modes, surrogate,
                                        time_calls)
from benchmarks.bench_megatron_micro_batches import make_rows, pack, plan  # noqa: E402

MODES = ("tp", "sp")


def _worker(rank, world, a, mode, out_path):
    from hacpo.models.megatron import MegatronPolicy, init_parallel

    torch.set_num_threads(a["threads"])
    par = init_parallel(a["tp"], a["pp"])
    prompts, resps, adv = make_rows(a)
    hf = llama(a, max_position_embeddings=max(len(p) + len(r) for p, r in zip(prompts, resps)))
    pol = MegatronPolicy.from_hf(hf, par, sequence_parallel=mode == "sp")
    del hf
    opt = pol.build_optimizer(lr=1e-3, optimizer="sgd")
    ids, targets, pos, mask = pack(prompts, resps)
    divisor = mask.sum().float()
    mbs = []
    for g in plan(a, prompts, resps, "rows"):
        idx = torch.tensor(g)
        S = max(len(prompts[j]) + len(resps[j]) for j in g)
        R = max(len(resps[j]) for j in g)
        mbs.append({"input_ids": ids[idx, :S], "targets": targets[idx, :S],
                    "positions": pos[idx, :R], "positions_mask": mask[idx, :R],
                    "adv": adv[idx], "divisor": divisor})

    def score():
        return pol.token_logprobs(ids, targets, positions=pos, mask=mask,
                                  micro_batch_size=a["micro_batch"])

    def step():
        return pol.train_step(opt, mbs, surrogate)

    time_calls(rank, world, pol, score, step, a["reps"], out_path,
               sequence_parallel=pol.sequence_parallel,
               padded_widths=[pol.padded_length(int(mb["input_ids"].shape[1])) for mb in mbs])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results_dir")
    add_model_args(p, tp=2, hidden=1024, ffn=2816, layers=4, heads=16, kv_heads=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt-min", type=int, default=32)
    p.add_argument("--prompt-max", type=int, default=128)
    p.add_argument("--response-mean", type=float, default=256.0)
    p.add_argument("--response-max", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=4, help="rows per micro-batch")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args(argv)
    if not os.path.exists("/proc/self/clear_refs"):
        p.error("needs Linux /proc (peak RSS reset through /proc/self/clear_refs)")
    if args.tp < 2:
        p.error("sequence parallelism needs --tp >= 2")
    if not (1 <= args.prompt_min <= args.prompt_max and args.response_max >= 1
            and args.response_mean > 0 and args.reps >= 1 and args.prompts >= 1
            and args.group >= 1 and args.micro_batch >= 1):
        p.error("need 1 <= prompt-min <= prompt-max, response-max >= 1, response-mean > 0, "
                "reps, prompts, group, micro-batch >= 1")

    a = {k: getattr(args, k) for k in ("tp", "pp", "hidden", "ffn", "layers", "heads",
                                       "kv_heads", "vocab", "prompts", "group", "prompt_min",
                                       "prompt_max", "response_mean", "response_max",
                                       "micro_batch", "reps", "threads")}
    prompts, resps, _ = make_rows(a)
    lens = [len(q) + len(r) for q, r in zip(prompts, resps)]
    runs = run_modes(_worker, args.tp * args.pp, a, MODES)
    if runs["tp"]["sequence_parallel"] or not runs["sp"]["sequence_parallel"]:
        raise RuntimeError("the policies did not run the modes asked for")
    lp_diff, w_diff, same = compare_runs(runs["tp"], runs["sp"])
    rows = call_rows(runs, MODES, micro_batches=lambda m, c: len(runs[m]["padded_widths"]),
                     widths=lambda m, c: runs[m]["padded_widths"])
    ratios = mode_ratios(rows, "tp", "sp")
    out = {"layout": a, **environment(),
           "row_tokens": sum(lens), "longest_row": max(lens), "shortest_row": min(lens),
           "response_tokens": sum(len(r) for r in resps),
           "max_abs_logprob_diff": lp_diff, "max_abs_weight_diff_after_steps": w_diff,
           "same_results": same, "rows": rows, "ratios": ratios}
    os.makedirs(args.results_dir, exist_ok=True)
    with open(os.path.join(args.results_dir, "sequence_parallel.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"tp={args.tp} pp={args.pp}, {len(lens)} rows ({args.prompts} prompts x "
          f"{args.group}), {sum(lens)} tokens (rows of {min(lens)}..{max(lens)}), "
          f"{out['response_tokens']} response tokens, V={args.vocab}, H={args.hidden}, "
          f"{args.layers} layers; {args.micro_batch} rows per micro-batch")
    print(f"{'mode':>4} {'call':>6} {'micro-batch widths':>28} {'p50 s (slowest rank)':>21} "
          f"{'peak MiB (max rank)':>20}")
    for r in rows:
        print(f"{r['mode']:>4} {r['call']:>6} {str(r['widths']):>28} "
              f"{max(r['seconds_p50_by_rank']):>21.3f} {max(r['peak_mib_by_rank']):>20.1f}")
    for name, q in ratios.items():
        print(f"sp / tp, {name}: time {q['time_sp_over_tp']:.2f}x, peak memory "
              f"{q['peak_sp_over_tp']:.3f}x")
    print(f"same results: {same} (log-probs {lp_diff:.2e}, weights after the steps "
          f"{w_diff:.2e})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
