"""A megatron-core policy's scoring and training step over RL-like rows (responses of widely
varying length) cut into micro-batches of a fixed row count (``parallel.micro_batch_tokens =
0``: rows ordered by prompt, as the trainer orders them) against micro-batches packed by a
token budget (``parallel.micro_batch_tokens``: hacpo/engine/batching.py), measured side by
side in one run.

    PYTHONPATH=. python benchmarks/bench_megatron_micro_batches.py RESULTS_DIR [--tp 1] [--pp 1]
        [--hidden 512 --ffn 1408 --layers 2 --heads 8 --kv-heads 2 --vocab 32768]
        [--prompts 8 --group 4 --prompt-min 32 --prompt-max 128 --response-mean 96
         --response-max 768] [--micro-batch 4] [--micro-batch-tokens N] [--reps 3]

CPU only: tp*pp gloo processes with megatron-core's CUDA calls mapped to CPU by the *test-only*
helper ``tests/megatron/_cpu_megatron.py`` (as the other megatron benchmarks; library code
never patches megatron). Each mode runs in fresh processes. The rows: ``--prompts`` random
prompts of lengths in [prompt-min, prompt-max], ``--group`` responses each whose lengths are
drawn from an exponential distribution of mean ``--response-mean`` capped at
``--response-max`` (seed 1: most responses short, a few long, as in RL). Modes:

- ``rows``: micro-batches of ``--micro-batch`` rows, rows ordered by (prompt length, prompt,
  response length) as the trainer's fixed path orders them, each padded to its longest row;
- ``tokens``: rows packed longest first into micro-batches of at most ``--micro-batch-tokens``
  padded tokens (default: ``--micro-batch`` x the longest row, the same worst-case
  micro-batch as ``rows``, so the same bound on activation memory).

Per mode on one rank's rows (DP=1): ``score`` = ``token_logprobs`` of the response tokens
(forward only, the old log-probs: in ``rows`` mode chunks of ``--micro-batch`` rows in the
order the rows were generated, as the trainer's old log-probs; in ``tokens`` mode with
``micro_batch_tokens``); ``step`` = one ``train_step`` over the mode's micro-batches with a
token-level surrogate loss and the global divisor (forward, backward, SGD). One warm-up call
each, then ``--reps`` timed calls; memory is the peak resident memory above the level before
the call (VmHWM reset through ``/proc/self/clear_refs``), the largest over the reps, per rank. Both modes must give the same
log-probs and, after the same steps, the same weights (checked and printed). Writes
RESULTS_DIR/micro_batches.json and prints a table.
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
from hacpo.engine.batching import pack_micro_batches, padded_tokens  # noqa: E402

MODES = ("rows", "tokens")


def make_rows(a):
    """Prompts and responses (token id lists; ``group`` responses per prompt, adjacent) and
    per-row advantages."""
    g = torch.Generator().manual_seed(1)
    prompts, resps = [], []
    for _ in range(a["prompts"]):
        n = int(torch.randint(a["prompt_min"], a["prompt_max"] + 1, (1,), generator=g))
        prompt = torch.randint(0, a["vocab"], (n,), generator=g).tolist()
        for _ in range(a["group"]):
            r = min(a["response_max"],
                    1 + int(torch.empty(1).exponential_(1 / a["response_mean"], generator=g)))
            prompts.append(prompt)
            resps.append(torch.randint(0, a["vocab"], (r,), generator=g).tolist())
    adv = torch.randn(len(resps), generator=g)
    return prompts, resps, adv


def pack(prompts, resps):
    """ids / targets [B, S] (prompt + response, right-padded), the response tokens' positions
    and mask [B, R]."""
    B = len(resps)
    S = max(len(p) + len(r) for p, r in zip(prompts, resps))
    R = max(len(r) for r in resps)
    ids = torch.zeros(B, S, dtype=torch.long)
    targets = torch.zeros(B, S, dtype=torch.long)
    pos = torch.zeros(B, R, dtype=torch.long)
    mask = torch.zeros(B, R, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, resps)):
        seq = torch.tensor(p + r)
        ids[i, :len(seq)] = seq
        targets[i, :len(seq) - 1] = seq[1:]
        pos[i, :len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
        mask[i, :len(r)] = True
    return ids, targets, pos, mask


def step_micro_batches(packed, prompts, resps, adv, groups) -> list[dict]:
    """``train_step``'s micro-batches: each group of rows cut from ``packed`` (:func:`pack`'s
    ids, targets, positions, mask) to its longest row and response, with its advantages and
    the whole batch's divisor (its response tokens)."""
    ids, targets, pos, mask = packed
    divisor = mask.sum().float()
    mbs = []
    for g in groups:
        idx = torch.tensor(g)
        S = max(len(prompts[j]) + len(resps[j]) for j in g)
        R = max(len(resps[j]) for j in g)
        mbs.append({"input_ids": ids[idx, :S], "targets": targets[idx, :S],
                    "positions": pos[idx, :R], "positions_mask": mask[idx, :R],
                    "adv": adv[idx], "divisor": divisor})
    return mbs


def add_row_args(p, **defaults) -> None:
    """The RL-like rows' flags (:func:`make_rows`) and ``--micro-batch``, with defaults."""
    d = {"prompts": 8, "group": 4, "prompt_min": 32, "prompt_max": 128, "response_mean": 96.0,
         "response_max": 768, **defaults}
    for name in ("prompts", "group", "prompt_min", "prompt_max", "response_max"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=d[name])
    p.add_argument("--response-mean", type=float, default=d["response_mean"])
    p.add_argument("--micro-batch", type=int, default=4, help="rows per micro-batch (in order "
                                                              "of prompt)")


def check_row_args(p, args) -> None:
    if not (1 <= args.prompt_min <= args.prompt_max and args.response_max >= 1
            and args.response_mean > 0 and args.reps >= 1 and args.prompts >= 1
            and args.group >= 1 and args.micro_batch >= 1):
        p.error("need 1 <= prompt-min <= prompt-max, response-max >= 1, response-mean > 0, "
                "reps, prompts, group, micro-batch >= 1")


def plan(a, prompts, resps, mode):
    """The micro-batches (row indices) of ``mode``; a row's length is prompt + response."""
    lens = [len(p) + len(r) for p, r in zip(prompts, resps)]
    if mode == "tokens":
        return pack_micro_batches(lens, a["micro_batch_tokens"], len(lens))
    order = sorted(range(len(lens)), key=lambda j: (len(prompts[j]), prompts[j], len(resps[j])))
    b = a["micro_batch"]
    return [order[s:s + b] for s in range(0, len(order), b)]


def score_plan(a, prompts, resps, mode):
    """The micro-batches (rows, row length) ``token_logprobs`` runs in ``mode``: each row cut
    after its last response token (prompt + response - 1)."""
    lens = [len(p) + len(r) - 1 for p, r in zip(prompts, resps)]
    if mode == "tokens":
        return pack_micro_batches(lens, a["micro_batch_tokens"], len(lens)), lens
    b = a["micro_batch"]
    return [list(range(s, min(s + b, len(lens)))) for s in range(0, len(lens), b)], lens


def _worker(rank, world, a, mode, out_path):
    from hacpo.models.megatron import MegatronPolicy, init_parallel

    torch.set_num_threads(a["threads"])
    par = init_parallel(a["tp"], a["pp"])
    prompts, resps, adv = make_rows(a)
    hf = llama(a, max_position_embeddings=max(len(p) + len(r) for p, r in zip(prompts, resps)))
    pol = MegatronPolicy.from_hf(hf, par)
    del hf
    opt = pol.build_optimizer(lr=1e-3, optimizer="sgd")
    packed = ids, targets, pos, mask = pack(prompts, resps)
    mbs = step_micro_batches(packed, prompts, resps, adv, plan(a, prompts, resps, mode))
    kw = ({"micro_batch_tokens": a["micro_batch_tokens"], "micro_batch_size": len(resps)}
          if mode == "tokens" else {"micro_batch_size": a["micro_batch"]})
    def score():
        return pol.token_logprobs(ids, targets, positions=pos, mask=mask, **kw)

    def step():
        return pol.train_step(opt, mbs, surrogate)

    time_calls(rank, world, pol, score, step, a["reps"], out_path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results_dir")
    add_model_args(p)
    add_row_args(p)
    p.add_argument("--micro-batch-tokens", type=int, default=0,
                   help="tokens mode: padded tokens per micro-batch (0: micro-batch x the "
                        "longest row)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args(argv)
    if not os.path.exists("/proc/self/clear_refs"):
        p.error("needs Linux /proc (peak RSS reset through /proc/self/clear_refs)")
    check_row_args(p, args)
    if args.micro_batch_tokens < 0:
        p.error("need micro-batch-tokens >= 0")

    results_dir(p, args.results_dir)
    a = {k: getattr(args, k) for k in ("tp", "pp", "hidden", "ffn", "layers", "heads",
                                       "kv_heads", "vocab", "prompts", "group", "prompt_min",
                                       "prompt_max", "response_mean", "response_max",
                                       "micro_batch", "micro_batch_tokens", "reps", "threads")}
    prompts, resps, _ = make_rows(a)
    lens = [len(q) + len(r) for q, r in zip(prompts, resps)]
    if not a["micro_batch_tokens"]:
        a["micro_batch_tokens"] = a["micro_batch"] * max(lens)
    plans = {(mode, "step"): (plan(a, prompts, resps, mode), lens) for mode in MODES}
    plans.update({(mode, "score"): score_plan(a, prompts, resps, mode) for mode in MODES})
    runs = run_modes(_worker, args.tp * args.pp, a, MODES)
    # fp32 throughout: the same rows in other micro-batches (GEMMs over other row counts)
    lp_diff, w_diff, same = compare_runs(runs["rows"], runs["tokens"])

    def largest_scored(mode, call):      # rows through the output layer (its logits chunk)
        return max(sum(len(resps[j]) for j in g) for g in plans[mode, call][0])

    rows = call_rows(
        runs, MODES, micro_batches=lambda m, c: len(plans[m, c][0]),
        padded_tokens=lambda m, c: padded_tokens(plans[m, c][1], plans[m, c][0]),
        largest_micro_batch_tokens=lambda m, c: max(padded_tokens(plans[m, c][1], [g])
                                                    for g in plans[m, c][0]),
        largest_micro_batch_scored=largest_scored)
    ratios = mode_ratios(rows, "rows", "tokens")
    out = {"layout": a, **environment(),
           "row_tokens": sum(lens), "longest_row": max(lens), "shortest_row": min(lens),
           "response_tokens": sum(len(r) for r in resps),
           "max_abs_logprob_diff": lp_diff, "max_abs_weight_diff_after_steps": w_diff,
           "same_results": same, "rows": rows, "ratios": ratios}
    with open(os.path.join(args.results_dir, "micro_batches.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"tp={args.tp} pp={args.pp}, {len(lens)} rows ({args.prompts} prompts x "
          f"{args.group}), {sum(lens)} tokens (rows of {min(lens)}..{max(lens)}), "
          f"{out['response_tokens']} response tokens, V={args.vocab}, H={args.hidden}; "
          f"rows: {args.micro_batch} per micro-batch; tokens: budget "
          f"{a['micro_batch_tokens']}")
    print(f"{'mode':>6} {'call':>6} {'micro-batches':>13} {'padded tokens':>13} "
          f"{'largest mb':>10} {'its scored':>10} {'p50 s (slowest rank)':>21} "
          f"{'peak MiB (max rank)':>20}")
    for r in rows:
        print(f"{r['mode']:>6} {r['call']:>6} {r['micro_batches']:>13} {r['padded_tokens']:>13} "
              f"{r['largest_micro_batch_tokens']:>10} {r['largest_micro_batch_scored']:>10} "
              f"{max(r['seconds_p50_by_rank']):>21.3f} {max(r['peak_mib_by_rank']):>20.1f}")
    for name, q in ratios.items():
        print(f"tokens / rows, {name}: time {q['time_tokens_over_rows']:.2f}x, peak memory "
              f"{q['peak_tokens_over_rows']:.3f}x")
    print(f"same results: {same} (log-probs {lp_diff:.2e}, weights after the steps "
          f"{w_diff:.2e})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
