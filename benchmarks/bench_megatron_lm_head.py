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
        return pol.train_step(opt, [mb], surrogate)

    time_calls(rank, world, pol, score, step, a["reps"], out_path,
               scored_tokens=int(mask.sum()), positions=int(ids.numel()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results_dir")
    add_model_args(p, vocab=65536)
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

    results_dir(p, args.results_dir)
    a = {k: getattr(args, k) for k in ("tp", "pp", "hidden", "ffn", "layers", "heads",
                                       "kv_heads", "vocab", "rows", "prompt", "response_min",
                                       "response_max", "reps", "threads")}
    runs = run_modes(_worker, args.tp * args.pp, a, MODES)
    ref = runs["logits"]
    # fp32 throughout: the same GEMM rows and log-softmax in another order
    lp_diff, w_diff, same = compare_runs(ref, runs["fused"])
    rows = call_rows(runs, MODES)
    ratios = mode_ratios(rows, "logits", "fused")
    B, P = args.rows, args.prompt
    S = P + args.response_max
    out = {"layout": a, **environment(),
           "scored_tokens": ref["scored_tokens"], "positions": ref["positions"],
           "logits_mib_per_rank": B * S * args.vocab / args.tp * 4 / 2 ** 20,
           "max_abs_logprob_diff": lp_diff, "max_abs_weight_diff_after_steps": w_diff,
           "same_results": same, "rows": rows, "ratios": ratios}
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
