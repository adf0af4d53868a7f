"""A step's generation and weight sync with the Ray rollout pool: every agent at once
(``generate_agents`` / ``sync_agents`` with the pool's ``concurrent_agents``, what the trainer
does) against one agent after another (what it did before), side by side in one run, on a
private local Ray cluster.

    PYTHONPATH=. python benchmarks/bench_rollout_agents.py [RESULTS_DIR] [--agents 2]
        [--reps 5] [--prompts 8] [--group 4] [--max-new-tokens 32] [--sync-reps 9]
        [--d-model D] [--layers L]

The agents are the ``tiny3`` preset's (char / reduced-vocab Qwen3 tokenizers; ``--agents 3``
adds its third; ``--d-model`` / ``--layers`` resize them, e.g. to sync more weights), one
rollout actor each with one CPU thread (``threads=1``), so the cluster
needs ``--agents`` CPUs for the two modes to be comparable. Each repetition samples the same
prompts in both modes from the same generator states (restored before every call), in
alternating order; the rollouts of the two modes must be identical (checked: the samples do
not depend on the order). Then the weight sync (the driver's policies into the object store,
every actor loads its agent's; ``--sync-reps`` times per mode, alternating; the agents are
in-process, so there is nothing to pull). Prints p20 / p50 / p80 seconds per mode and the
ratio of medians, for each phase; with RESULTS_DIR writes ``rollout_agents.json`` there.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks._timing import pct, percentiles, results_dir  # noqa: E402


def _print_modes(by_mode: dict[str, list[float]]) -> None:
    for m, ts in by_mode.items():
        print(f"  {m:<18} p20 {pct(ts, 0.2):7.3f} s  p50 {pct(ts, 0.5):7.3f} s  "
              f"p80 {pct(ts, 0.8):7.3f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results_dir", nargs="?")
    ap.add_argument("--agents", type=int, default=2, choices=(2, 3))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--sync-reps", type=int, default=9)
    ap.add_argument("--d-model", type=int, default=0, help="every agent's width (0: tiny3's)")
    ap.add_argument("--layers", type=int, default=0, help="every agent's depth (0: tiny3's)")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.sync_reps < 0:
        ap.error("--reps must be >= 1 (the generation is timed) and --sync-reps >= 0")
    if min(a.prompts, a.group, a.max_new_tokens) < 1:
        ap.error("--prompts, --group and --max-new-tokens must be >= 1")
    if min(a.d_model, a.layers) < 0:
        ap.error("--d-model and --layers must be >= 1 (or 0: tiny3's)")
    if a.results_dir:
        results_dir(ap, a.results_dir)

    import hacpo.launch.ray_cluster  # noqa: F401  (first: a private cluster binds to loopback)
    from hacpo.engine import build
    from hacpo.engine.rollout import generate_agents, sync_agents
    from hacpo.engine.run_config import load_config
    from hacpo.engine.timing import Stopwatch
    from hacpo.launch.ray_rollout import RayRolloutEngine

    tmp = tempfile.mkdtemp(prefix="hacpo-bench-rollout-")
    try:
        cfg = load_config("tiny3", overrides={
            "out_dir": os.path.join(tmp, "run"), "cache_dir": os.path.join(tmp, "cache"),
            "threads": 1, "plots": False, "tensorboard": False, "rollout.engine": "ray"})
        cfg = dataclasses.replace(cfg, agents=cfg.agents[:a.agents])
        size = {**({"d_model": a.d_model} if a.d_model else {}),
                **({"n_layers": a.layers} if a.layers else {})}
        cfg = cfg.override({f"agents.{k}.policy.{key}": v for k in range(a.agents)
                            for key, v in size.items()})
        data = build.load_data(cfg)
        policies = build.build_policies(cfg, data)
        prompts = [[p.tokenizer.prompt_ids(build.prompt_text(cfg, e))
                    for e in data.train[:a.prompts]] for p in policies]
        kw = dict(num_samples=a.group, max_new_tokens=a.max_new_tokens, temperature=1.0,
                  top_p=1.0)
        engine = RayRolloutEngine(policies, cfg)
        times: dict[str, list[float]] = {"at once": [], "one after another": []}
        syncs: dict[str, list[float]] = {"at once": [], "one after another": []}
        try:
            for k in range(len(policies)):
                engine.sync_weights(k)
            start = engine.state_dict()
            generate_agents(engine, prompts, timer=Stopwatch(), **kw)   # warm-up (both paths run
            for rep in range(a.reps):                                    # the same actors)
                modes = list(times) if rep % 2 == 0 else list(reversed(times))
                got = {}
                for mode in modes:
                    engine.load_state_dict(start)
                    engine.concurrent_agents = mode == "at once"
                    sw = Stopwatch()
                    t0 = time.perf_counter()
                    got[mode] = generate_agents(engine, prompts,
                                                timer=lambda k: sw(f"time/generate/{k}"), **kw)
                    times[mode].append(time.perf_counter() - t0)
                for x, y in zip(*got.values()):
                    if (x.response_ids, x.sampler_logprobs) != (y.response_ids, y.sampler_logprobs):
                        raise AssertionError(f"agent {x.policy_name!r}: the two modes sampled "
                                             f"different rollouts")
                start = engine.state_dict()
            for rep in range(a.sync_reps):
                for mode in (list(syncs) if rep % 2 == 0 else list(reversed(syncs))):
                    engine.concurrent_agents = mode == "at once"
                    t0 = time.perf_counter()
                    sync_agents(None, engine, len(policies), timer=Stopwatch(), pull=False)
                    syncs[mode].append(time.perf_counter() - t0)
        finally:
            engine.close()
    finally:                                   # the run's cache and out_dir
        shutil.rmtree(tmp, ignore_errors=True)

    tokens = sum(len(r) for ro in got["at once"] for r in ro.response_ids)
    res = {"agents": a.agents, "prompts": a.prompts, "group": a.group,
           "max_new_tokens": a.max_new_tokens, "reps": a.reps, "tokens_per_call": tokens,
           "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
           "torch": torch.__version__, "seconds": times, **percentiles(times)}
    res["ratio_p50"] = res["p50"]["one after another"] / res["p50"]["at once"]
    weight_bytes = sum(t.numel() * t.element_size() for p in policies
                       for t in p.state_dict().values())
    res["sync"] = {"reps": a.sync_reps, "weight_bytes": weight_bytes, "seconds": syncs}
    if a.sync_reps:
        res["sync"].update(percentiles(syncs))
    print(f"{a.agents} agents x {a.prompts} prompts x {a.group} samples, <= {a.max_new_tokens} "
          f"new tokens ({tokens} generated per call), {a.reps} reps, {os.cpu_count()} CPUs")
    _print_modes(times)
    print(f"  one after another / at once (p50): {res['ratio_p50']:.2f}x")
    if a.sync_reps:
        sy = res["sync"]
        sy["ratio_p50"] = sy["p50"]["one after another"] / sy["p50"]["at once"]
        print(f"weight sync: {weight_bytes / 2**20:.2f} MiB over {len(policies)} agents, "
              f"{a.sync_reps} reps")
        _print_modes(syncs)
        print(f"  sync one after another / at once (p50): {sy['ratio_p50']:.2f}x")
    if a.results_dir:
        with open(os.path.join(a.results_dir, "rollout_agents.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
