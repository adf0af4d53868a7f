"""Algorithm-library benchmark: HACPO advantages and loss forward+backward at N = 1,000,000.

Measures, side by side in one run, the vectorized library functions and a naive Python loop
implementation of the same math (plain floats, per-sample loop), and prints times and ratios.
Target (issue "HACPO core"): advantages under 1 s on the 2-core CI machine.

    python benchmarks/bench_algorithms.py [--n-samples 1000000] [--agents 4] [--group 16]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks._timing import pct, results_file  # noqa: E402
from hacpo.engine import CapabilityTracker, hacpo_advantages, hacpo_policy_loss  # noqa: E402


def make_pool(N: int, n: int, G: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    per_prompt = n * G
    P = N // per_prompt
    N = P * per_prompt
    prompt = torch.arange(P).repeat_interleave(per_prompt)
    agent = torch.arange(n).repeat_interleave(G).repeat(P)
    skill = torch.linspace(0.2, 0.7, n)
    rewards = (torch.rand(N, generator=g) < skill[agent]).float()
    tracker = CapabilityTracker(n)
    tracker.update(rewards, agent)
    return rewards, prompt, agent, tracker.ratios()


def loop_advantages(r, p, a, learner, om, eps=1e-6):
    """Naive Python: dicts per group, one pass per sample."""
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(p):
        groups.setdefault(g, []).append(i)
    out = [0.0] * len(r)
    for idx in groups.values():
        rs = [r[i] for i in idx]
        mean = sum(rs) / len(rs)
        mu = sum(r[i] / om[a[i]][learner] for i in idx) / len(idx)
        if max(rs) == min(rs):
            mu = mean
        if mu > 1:
            own = [r[i] for i in idx if a[i] == learner]
            mu = sum(own) / len(own) if own else mean
        var = sum((x - mean) ** 2 for x in rs) / (len(rs) - 1) if len(rs) > 1 else 0.0
        sd = math.sqrt(var) + eps
        for i in idx:
            out[i] = (r[i] - mu) / sd
    return out


def loop_loss_and_grad(new, old, A, is_self, om, lo, alpha=1.0):
    """Naive Python forward + analytic backward (d loss / d new_lp) per sample."""
    N = len(new)
    total, grad = 0.0, [0.0] * N
    for i in range(N):
        ls = max(-10.0, min(10.0, new[i] - old[i]))
        s = math.exp(ls)
        d_ls = 1.0 if -10.0 < new[i] - old[i] < 10.0 else 0.0
        if is_self[i]:
            sc = min(max(s, 1 - 3e-4), 1 + 4e-4)
            u, c = s * A[i], sc * A[i]
            obj, d = (u, s * A[i]) if u <= c else (c, (s * A[i] if sc == s else 0.0))
        else:
            c = min(max(s, lo), 1.0)
            obj = c * c ** alpha * om[i] * A[i]
            d = c ** (1 + alpha) * om[i] * A[i] if lo <= s <= 1.0 else 0.0
        total += obj
        grad[i] = -d * d_ls / N
    return -total / N, grad


def timeit(fn, repeat: int):
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-samples", type=int, default=1_000_000)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--group", type=int, default=16, help="G responses per agent per prompt")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", default=None, help="also write results to this JSON file")
    args = ap.parse_args(argv)
    if args.agents < 1 or args.group < 1:
        ap.error("--agents and --group must be >= 1")
    if args.n_samples < args.agents * args.group:
        ap.error(f"--n-samples {args.n_samples} is less than one prompt's samples "
                 f"(--agents x --group = {args.agents * args.group})")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.json:
        results_file(ap, args.json)

    r, p, a, om = make_pool(args.n_samples, args.agents, args.group)
    N = r.numel()
    results = {"N": N, "agents": args.agents, "G": args.group, "torch": torch.__version__,
               "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()}

    # ---- advantages (learner 0) ----
    hacpo_advantages(r, p, a, learner=0, ratios=om)                   # warm-up
    t_vec = timeit(lambda: hacpo_advantages(r, p, a, learner=0, ratios=om), args.repeat)
    rl, pl, al, oml = r.tolist(), p.tolist(), a.tolist(), om.tolist()
    t0 = time.perf_counter()
    ref = loop_advantages(rl, pl, al, 0, oml)
    t_loop = time.perf_counter() - t0
    got = hacpo_advantages(r, p, a, learner=0, ratios=om)
    max_err = (got.double() - torch.tensor(ref, dtype=torch.float64)).abs().max().item()
    results["advantages"] = {"vectorized_p20_s": pct(t_vec, .2), "vectorized_p50_s": pct(t_vec, .5),
                             "vectorized_p80_s": pct(t_vec, .8), "python_loop_s": t_loop,
                             "speedup": t_loop / pct(t_vec, .5), "max_abs_diff": max_err}

    # ---- loss forward + backward ----
    g = torch.Generator().manual_seed(1)
    old = torch.randn(N, generator=g) * 0.05
    base = old + torch.randn(N, generator=g) * 0.1
    is_self = a == 0
    omega = om[a, 0].float()
    A = got

    def fwd_bwd():
        new = base.clone().requires_grad_()
        loss, _ = hacpo_policy_loss(new, old, A, is_self, omega, minibatch_index=2)
        loss.backward()
        return loss, new.grad

    fwd_bwd()
    t_vec = timeit(fwd_bwd, args.repeat)
    loss, grad = fwd_bwd()
    lo = 1 - 0.2 + 2 * 0.025
    t0 = time.perf_counter()
    ref_loss, ref_grad = loop_loss_and_grad(base.tolist(), old.tolist(), A.tolist(),
                                            is_self.tolist(), omega.tolist(), lo)
    t_loop = time.perf_counter() - t0
    grad_err = (grad.double() - torch.tensor(ref_grad, dtype=torch.float64)).abs().max().item()
    results["loss_fwd_bwd"] = {"vectorized_p20_s": pct(t_vec, .2),
                               "vectorized_p50_s": pct(t_vec, .5),
                               "vectorized_p80_s": pct(t_vec, .8), "python_loop_s": t_loop,
                               "speedup": t_loop / pct(t_vec, .5),
                               "loss_abs_diff": abs(loss.item() - ref_loss),
                               "grad_max_abs_diff": grad_err}

    print(f"hacpo algorithm benchmark: N={N:,} samples, n={args.agents} agents, G={args.group}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in ("advantages", "loss_fwd_bwd"):
        d = results[name]
        print(f"  {name:13s} vectorized p20/p50/p80 = {d['vectorized_p20_s']*1e3:7.1f} / "
              f"{d['vectorized_p50_s']*1e3:7.1f} / {d['vectorized_p80_s']*1e3:7.1f} ms   "
              f"python loop = {d['python_loop_s']*1e3:8.1f} ms   speedup x{d['speedup']:.1f}")
    print(f"  agreement with the loop: advantages max |diff| = "
          f"{results['advantages']['max_abs_diff']:.2e}, loss |diff| = "
          f"{results['loss_fwd_bwd']['loss_abs_diff']:.2e}, grad max |diff| = "
          f"{results['loss_fwd_bwd']['grad_max_abs_diff']:.2e}")
    target = results["advantages"]["vectorized_p50_s"] < 1.0
    print(f"  target advantages < 1 s: {'MET' if target else 'MISSED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
