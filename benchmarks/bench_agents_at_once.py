"""A training run's phases with every agent at once (``agents_at_once=true``, the default)
against one agent after another (``false``), side by side: the same run (Ray rollout pool,
Ray trainer actors, the ``tiny3`` agents) trained in both modes, alternating.

    PYTHONPATH=. python benchmarks/bench_agents_at_once.py [RESULTS_DIR] [--agents 2]
        [--steps 5] [--runs 1] [--prompts 8] [--group 4] [--max-new-tokens 16]

tiny3's ``max_len`` (128) bounds a prompt plus ``--max-new-tokens``. Each run is a fresh
``train()`` (its own private Ray cluster; warm-up shared through one
cache); ``--runs`` pairs, the order alternating. Every metric but wall times must be
identical between the modes (the samples and updates do not depend on the mode: checked,
exit 1 otherwise). Per mode, over every step but each run's first: p20 / p50 / p80 seconds
of the phases ``time/generate``, ``time/old_logprobs``, ``time/update``, ``time/sync`` and of
``time/step``, and the ratio of medians; with RESULTS_DIR writes ``agents_at_once.json`` there.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks._timing import QUANTILES, pct, percentiles, results_dir  # noqa: E402

PHASES = ("time/generate", "time/old_logprobs", "time/update", "time/sync", "time/step")
MODES = {"at once": True, "one after another": False}


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "reward_fn/seconds"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results_dir", nargs="?")
    ap.add_argument("--agents", type=int, default=2, choices=(2, 3))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    a = ap.parse_args(argv)
    if a.steps < 2 or a.runs < 1:      # each run's first step is not measured
        ap.error("--steps must be >= 2 (each run's first step is not measured) and --runs >= 1")
    if min(a.prompts, a.group, a.max_new_tokens) < 1:
        ap.error("--prompts, --group and --max-new-tokens must be >= 1")
    if a.results_dir:
        results_dir(ap, a.results_dir)

    import dataclasses

    import hacpo.launch.ray_cluster  # noqa: F401  (first: a private cluster binds to loopback)
    from hacpo.engine.run_config import load_config
    from hacpo.engine.trainer import train

    tmp = tempfile.mkdtemp(prefix="hacpo-bench-at-once-")
    times = {m: {p: [] for p in PHASES} for m in MODES}
    reference = None
    try:
        for r in range(a.runs):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for mode in order:
                out = os.path.join(tmp, f"run{r}-{MODES[mode]}")
                cfg = load_config("tiny3", overrides={
                    "out_dir": out, "cache_dir": os.path.join(tmp, "cache"), "threads": 1,
                    "plots": False, "tensorboard": False, "progress": False, "steps": a.steps,
                    "prompts_per_step": a.prompts, "rollout.group_size": a.group,
                    "rollout.max_new_tokens": a.max_new_tokens, "rollout.engine": "ray",
                    "trainer_backend": "ray", "checkpoint_every": a.steps,
                    "agents_at_once": MODES[mode]})
                cfg = dataclasses.replace(cfg, agents=cfg.agents[:a.agents])
                train(cfg, echo=lambda *_: None)
                with open(os.path.join(out, "metrics.jsonl")) as f:
                    rows = [json.loads(line) for line in f]
                if reference is None:
                    reference = [_comparable(row) for row in rows]
                elif [_comparable(row) for row in rows] != reference:
                    print(f"run {r} ({mode}): metrics differ from the first run's",
                          file=sys.stderr)
                    return 1
                for row in rows[1:]:
                    for p in PHASES:
                        times[mode][p].append(row[p])
    finally:                     # the runs' folders (checkpoints, metrics) go with the benchmark
        shutil.rmtree(tmp, ignore_errors=True)

    res = {"agents": a.agents, "steps": a.steps, "runs": a.runs, "prompts": a.prompts,
           "group": a.group, "max_new_tokens": a.max_new_tokens, "cpus": os.cpu_count(),
           "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
           "seconds": times, "identical_metrics": True}
    per_mode = {m: percentiles(times[m]) for m in MODES}
    for key in per_mode["at once"]:
        res[key] = {m: per_mode[m][key] for m in MODES}
    res["ratio_p50"] = {p: res["p50"]["one after another"][p] / res["p50"]["at once"][p]
                        for p in PHASES}
    print(f"{a.agents} agents (Ray pool + Ray trainer actors, threads=1), {a.prompts} prompts x "
          f"{a.group} samples, <= {a.max_new_tokens} new tokens, {a.steps} steps x {a.runs} "
          f"run(s) per mode, {os.cpu_count()} CPUs; metrics identical in both modes")
    for p in PHASES:
        cells = "  ".join(f"{m}: " + " ".join(f"p{int(q * 100)} {pct(times[m][p], q):6.3f}"
                                              for q in QUANTILES) + " s" for m in MODES)
        print(f"  {p:<14} {cells}  ratio {res['ratio_p50'][p]:.2f}x")
    if a.results_dir:
        with open(os.path.join(a.results_dir, "agents_at_once.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
