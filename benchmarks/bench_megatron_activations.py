"""A megatron-core TP policy's scoring and training step under the activation-memory levers
megatron offers (``parallel.sequence_parallel``: norms and residuals hold S/tp positions per TP
rank; ``parallel.recompute``: parts of each layer, or whole layers, run again in the backward
instead of keeping their activations; hacpo/models/megatron/build.py), measured side by side
in one run on the same RL-like rows.

    PYTHONPATH=. python benchmarks/bench_megatron_activations.py RESULTS_DIR [--tp 2] [--pp 1]
        [--hidden 1024 --ffn 2816 --layers 4 --heads 16 --kv-heads 4 --vocab 32768]
        [--prompts 4 --group 4 --prompt-min 32 --prompt-max 128 --response-mean 256
         --response-max 1024] [--micro-batch 4] [--reps 2]
        [--modes off,sp,selective,full,sp+full]

CPU only: tp*pp gloo processes with megatron-core's CUDA calls mapped to CPU by the *test-only*
helper ``tests/megatron/_cpu_megatron.py`` (as the other megatron benchmarks; library code
never patches megatron). Each mode runs in fresh processes. The rows are those of
bench_megatron_micro_batches.py (``--group`` responses per prompt, exponential lengths), cut
into micro-batches of ``--micro-batch`` rows ordered by prompt (the trainer's default). Modes
(``off`` is the baseline of the ratios and always runs first):

- ``off``: neither; ``sp``: sequence parallelism (each micro-batch padded to a multiple of tp);
- ``selective``: the attention core and the MLP of every layer recomputed;
- ``full``: every layer recomputed whole from its input; ``sp+full``: both levers.

Per mode: ``score`` = ``token_logprobs`` of the response tokens (forward only, the old
log-probs; recomputation does not apply there); ``step`` = one ``train_step`` with a
token-level surrogate loss and the global divisor (forward, backward, SGD). One warm-up call
each, then ``--reps`` timed calls; memory is the peak resident memory above the level before
the call (VmHWM reset through ``/proc/self/clear_refs``), the largest over the reps, per rank.
Every mode must give the baseline's log-probs and, after the same steps, its weights (checked
and printed). Writes RESULTS_DIR/activations.json and prints a table. On CPU, gloo's
all-gather and reduce-scatter are slower than its all-reduce relative to compute, so the time
ratios of ``sp`` say little about NCCL on GPUs; the memory ratios are the point.
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
from benchmarks._timing import results_dir  # noqa: E402
from benchmarks.bench_megatron_micro_batches import (add_row_args, check_row_args,  # noqa: E402
                                                     make_rows, pack, plan, step_micro_batches)

FULL = {"recompute": "full", "num_layers": 1}
MODES = {"off": (False, None), "sp": (True, None),
         "selective": (False, {"recompute": "selective", "modules": ["core_attn", "mlp"]}),
         "full": (False, FULL), "sp+full": (True, FULL)}   # (sequence_parallel, recompute)


def _worker(rank, world, a, mode, out_path):
    from hacpo.models.megatron import MegatronPolicy, init_parallel

    torch.set_num_threads(a["threads"])
    par = init_parallel(a["tp"], a["pp"])
    prompts, resps, adv = make_rows(a)
    hf = llama(a, max_position_embeddings=max(len(p) + len(r) for p, r in zip(prompts, resps)))
    sp, recompute = MODES[mode]
    pol = MegatronPolicy.from_hf(hf, par, sequence_parallel=sp, recompute=recompute)
    del hf
    opt = pol.build_optimizer(lr=1e-3, optimizer="sgd")
    packed = ids, targets, pos, mask = pack(prompts, resps)
    mbs = step_micro_batches(packed, prompts, resps, adv, plan(a, prompts, resps, "rows"))

    def score():
        return pol.token_logprobs(ids, targets, positions=pos, mask=mask,
                                  micro_batch_size=a["micro_batch"])

    def step():
        return pol.train_step(opt, mbs, surrogate)

    cfg = pol.module.config
    time_calls(rank, world, pol, score, step, a["reps"], out_path,
               built=(cfg.sequence_parallel, cfg.recompute_granularity),
               padded_widths=[pol.padded_length(int(mb["input_ids"].shape[1])) for mb in mbs])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results_dir")
    add_model_args(p, tp=2, hidden=1024, ffn=2816, layers=4, heads=16, kv_heads=4)
    add_row_args(p, prompts=4, response_mean=256.0, response_max=1024)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, from {', '.join(MODES)} (off always runs)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args(argv)
    if not os.path.exists("/proc/self/clear_refs"):
        p.error("needs Linux /proc (peak RSS reset through /proc/self/clear_refs)")
    modes = ["off"] + [m for m in dict.fromkeys(args.modes.split(",")) if m != "off"]
    if set(modes) - set(MODES):
        p.error(f"unknown mode(s) {sorted(set(modes) - set(MODES))}; from {', '.join(MODES)}")
    if args.tp < 2 and any(MODES[m][0] for m in modes):
        p.error("sequence parallelism needs --tp >= 2")
    check_row_args(p, args)

    results_dir(p, args.results_dir)
    a = {k: getattr(args, k) for k in ("tp", "pp", "hidden", "ffn", "layers", "heads",
                                       "kv_heads", "vocab", "prompts", "group", "prompt_min",
                                       "prompt_max", "response_mean", "response_max",
                                       "micro_batch", "reps", "threads")}
    prompts, resps, _ = make_rows(a)
    lens = [len(q) + len(r) for q, r in zip(prompts, resps)]
    runs = run_modes(_worker, args.tp * args.pp, a, modes)
    for m in modes:
        sp, rc = MODES[m]
        if runs[m]["built"] != (sp, rc and rc["recompute"]):
            raise RuntimeError(f"mode {m}: the policy was built with {runs[m]['built']}")
    same = {m: compare_runs(runs["off"], runs[m]) for m in modes[1:]}
    rows = call_rows(runs, modes, micro_batches=lambda m, c: len(runs[m]["padded_widths"]),
                     widths=lambda m, c: runs[m]["padded_widths"])
    ratios = {m: mode_ratios(rows, "off", m) for m in modes[1:]}
    out = {"layout": a, **environment(), "modes": {m: {"sequence_parallel": MODES[m][0],
                                                       "recompute": MODES[m][1]} for m in modes},
           "row_tokens": sum(lens), "longest_row": max(lens), "shortest_row": min(lens),
           "response_tokens": sum(len(r) for r in resps),
           "vs_off": {m: {"max_abs_logprob_diff": d[0], "max_abs_weight_diff_after_steps": d[1],
                          "same_results": d[2]} for m, d in same.items()},
           "same_results": all(d[2] for d in same.values()), "rows": rows, "ratios": ratios}
    with open(os.path.join(args.results_dir, "activations.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"tp={args.tp} pp={args.pp}, {len(lens)} rows ({args.prompts} prompts x "
          f"{args.group}), {sum(lens)} tokens (rows of {min(lens)}..{max(lens)}), "
          f"{out['response_tokens']} response tokens, V={args.vocab}, H={args.hidden}, "
          f"{args.layers} layers; {args.micro_batch} rows per micro-batch")
    print(f"{'mode':>9} {'call':>6} {'micro-batch widths':>28} {'p50 s (slowest rank)':>21} "
          f"{'peak MiB (max rank)':>20}")
    for r in rows:
        print(f"{r['mode']:>9} {r['call']:>6} {str(r['widths']):>28} "
              f"{max(r['seconds_p50_by_rank']):>21.3f} {max(r['peak_mib_by_rank']):>20.1f}")
    for m, q in ratios.items():
        for name, v in q.items():
            print(f"{m} / off, {name}: time {v[f'time_{m}_over_off']:.2f}x, peak memory "
                  f"{v[f'peak_{m}_over_off']:.3f}x")
    for m, (lp_diff, w_diff, ok) in same.items():
        print(f"{m}: same results as off: {ok} (log-probs {lp_diff:.2e}, weights after the "
              f"steps {w_diff:.2e})")
    return 0 if out["same_results"] else 1


if __name__ == "__main__":
    sys.exit(main())
