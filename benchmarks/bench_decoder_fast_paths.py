"""The plain decoder's CPU fast paths vs the reference code they replaced, side by side in one
process, on one RL step's work of the embedded default run (``hacpo train``: the
``char-small`` and ``qwen3-large`` decoders of the default config, its 64 prompts x G=8):

    generate       the KV-cache sampler: 64 prompts x 8 samples, up to 40 new tokens, T=0.7
    old_logprobs   teacher-forced log-probs of the 512 samples, no grad (prompts shared)
    update         one pass over the 512 samples as the update runs them: blocks of 16
                   prompts encoded once, their 128 self and 128 cross rows scored on the
                   prompt states, backward of each part, then of the prompts

    PYTHONPATH=. python benchmarks/bench_decoder_fast_paths.py [--reps 7] [--threads 1]
        [--prompts 64] [--json PATH]

The fast paths (``hacpo.models.decoder.qkv_rope``, ``KVCache.repeat_interleave``, the
vectorized index building of ``Policy.continuation_logprobs``) and the reference code (kept
in ``tests/models/test_fast_paths_bitwise.py``) alternate every repetition (the first of each
is a warm-up, not measured); every repetition of both must give the same bits (rollouts,
sampler log-probs, log-probs, gradients): the script stops with an error otherwise. Prints
p20 / p50 / p80 seconds per stage, old and new, and the ratio of the p50s.

Responses are the embedded task's worked solutions in each agent's tokenizer (lengths as in
the run), with a random 0-3 tokens cut off the end (rows of a prompt differ); the weights are
the policies' initial ones (random, so the sampler mostly runs to 40 new tokens: more decode
steps than the run's ~25; the comparison is per step all the same).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks._timing import QUANTILES, pct, results_file  # noqa: E402

STAGES = ("generate", "old_logprobs", "update")


def _workload(policy, cfg, data, n_prompts: int, G: int, seed: int):
    from hacpo.engine import build

    tok = policy.tokenizer
    g = torch.Generator().manual_seed(seed)
    exs = data.train[:n_prompts]
    prompts = [tok.prompt_ids(build.prompt_text(cfg, e)) for e in exs]
    rows_p, rows_r = [], []
    for i, e in enumerate(exs):
        sol = tok.encode(data.target_text(e)) + [tok.eos_id]
        for _ in range(G):
            cut = int(torch.randint(0, 4, (), generator=g))
            rows_p.append(i)
            rows_r.append(sol[:max(1, len(sol) - cut)])
    return prompts, rows_p, rows_r


def _step(policy, prompts, rows_p, rows_r, *, G, max_new_tokens, temperature, block):
    """One RL step's work of one agent -> ({stage: seconds}, results to compare)."""
    from hacpo.models.generation import generate

    times, out = {}, []
    t = time.perf_counter()
    ro = generate(policy, prompts, num_samples=G, max_new_tokens=max_new_tokens,
                  temperature=temperature, generator=torch.Generator().manual_seed(1))
    times["generate"] = time.perf_counter() - t
    out += [ro.response_ids, ro.sampler_logprobs]
    t = time.perf_counter()
    with torch.no_grad():
        lp, _ = policy.response_logprobs([prompts[i] for i in rows_p], rows_r,
                                         temperature=temperature)
    times["old_logprobs"] = time.perf_counter() - t
    out.append(lp)
    t = time.perf_counter()
    policy.zero_grad(set_to_none=True)
    rows_per_block = block * G
    for s in range(0, len(rows_p), rows_per_block):
        rp, rr = rows_p[s:s + rows_per_block], rows_r[s:s + rows_per_block]
        first = rp[0]
        states = policy.encode_prompts(prompts[first:rp[-1] + 1])
        leaves = states.detached()
        for part in (rr, rr[::-1]):            # "self" and "cross" rows of the block
            lp, mask = policy.continuation_logprobs(leaves, [i - first for i in rp], part,
                                                    temperature=temperature)
            ((lp * mask).sum(-1) / mask.sum(-1)).sum().backward()
            out.append(lp.detach())
        states.backward_from(leaves)
    times["update"] = time.perf_counter() - t
    out += [p.grad.clone() for p in policy.parameters()]
    return times, out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7, help="measured repetitions of each")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=64, help="prompts per step (the run's: 64)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.reps < 1 or args.prompts < 1 or args.threads < 1:
        ap.error("--reps, --prompts and --threads must be >= 1")
    if args.json:
        results_file(ap, args.json)

    from hacpo.engine import build
    from hacpo.engine.run_config import load_config
    from tests.models.test_fast_paths_bitwise import reference_code

    cfg = load_config("default", overrides={"data.eval_size": "0", "threads": "0"})
    torch.set_num_threads(args.threads)
    data = build.load_data(cfg)
    policies = build.build_policies(cfg, data)
    G, block = cfg.rollout.group_size, 16
    work = {p.name: _workload(p, cfg, data, args.prompts, G, seed=k)
            for k, p in enumerate(policies)}
    kw = dict(G=G, max_new_tokens=cfg.rollout.max_new_tokens,
              temperature=cfg.rollout.temperature, block=block)
    times = {v: {p.name: {s: [] for s in STAGES} for p in policies} for v in ("old", "new")}
    first: dict = {}
    for rep in range(args.reps + 1):
        for variant in (("old", "new") if rep % 2 == 0 else ("new", "old")):
            for p in policies:
                if variant == "old":
                    with reference_code():
                        t, res = _step(p, *work[p.name], **kw)
                else:
                    t, res = _step(p, *work[p.name], **kw)
                ref = first.setdefault(p.name, res)
                if not _same(ref, res):
                    raise SystemExit(f"{p.name}: the {variant} code gave other results than "
                                     f"the first run (repetition {rep})")
                if rep:
                    for s in STAGES:
                        times[variant][p.name][s].append(t[s])
    rows = {}
    print(f"{args.reps} repetitions each, alternating; {args.threads} thread(s); "
          f"{args.prompts} prompts x G={G}; results bit-identical: yes")
    print(f"{'agent':12s} {'stage':13s} {'old p20/p50/p80 (s)':>24s}   "
          f"{'new p20/p50/p80 (s)':>24s}   new/old p50")
    for p in policies:
        tot = {v: [sum(times[v][p.name][s][i] for s in STAGES) for i in range(args.reps)]
               for v in ("old", "new")}
        for s in STAGES + ("total",):
            q = {v: [pct(times[v][p.name][s] if s != "total" else tot[v], x)
                     for x in QUANTILES] for v in ("old", "new")}
            rows[f"{p.name}/{s}"] = {"old": q["old"], "new": q["new"],
                                     "ratio_p50": q["new"][1] / q["old"][1]}
            print(f"{p.name:12s} {s:13s} {'/'.join(f'{x:.3f}' for x in q['old']):>24s}   "
                  f"{'/'.join(f'{x:.3f}' for x in q['new']):>24s}   "
                  f"{q['new'][1] / q['old'][1]:.3f}")
    result = {"reps": args.reps, "threads": args.threads, "prompts": args.prompts,
              "same_results": True, "rows": rows,
              "seconds": {v: times[v] for v in ("old", "new")}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
