"""In-process sampling (``hacpo.models.generation.generate``): time per generated token and
device->host reads per generated token, this checkout's against ``generation.py`` of an older
git revision, side by side in one run.

    PYTHONPATH=. python benchmarks/bench_generation_syncs.py --baseline REV [RESULTS_DIR]
        [--reps 7] [--prompts 16] [--group 4] [--max-new-tokens 48] [--temperature 1.0]
        [--top-p 1.0] [--threads 1] [--device cpu]

``REV`` is a git revision whose ``hacpo/models/generation.py`` is the baseline, e.g.
``1b5a622`` (the last one whose loop read the device twice per token and used
``torch.multinomial``). The policy is the default tiny decoder
(``PolicyConfig(kind="decoder")``, char tokenizer). Each repetition runs both versions on the
same prompts from the same generator seed, in alternating order; their rollouts must be
identical (checked). A rollout stops when every sample has produced EOS, so the time is
divided by the number of decoding steps (the longest response). Host reads are counted once
per version with the profiler (``aten::_local_scalar_dense``: item / bool / int, also inside
torch ops) plus ``Tensor.tolist`` calls, at two lengths of responses that never end early;
the difference per token excludes the per-rollout reads (prefill, the final copy). Prints
p20 / p50 / p80 seconds per token per version; with RESULTS_DIR writes
``generation_syncs.json`` there.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks._timing import percentiles, positive_int, results_dir  # noqa: E402
from hacpo.models import generation as current  # noqa: E402
from hacpo.models.policy import PolicyConfig, build_policy  # noqa: E402

QUESTIONS = ["What is {a}+{b}?", "Tom has {a} apples and eats {b}. How many are left?",
             "{a}*{b}=?", "A train goes {a} km in {b} hours. Its speed?"]


def load_baseline(rev: str):
    """``hacpo/models/generation.py`` at git revision ``rev``, imported as a module."""
    try:
        src = subprocess.run(["git", "show", f"{rev}:hacpo/models/generation.py"], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"--baseline {rev!r}: git show failed: {e.stderr.strip()}") from None
    mod = types.ModuleType("generation_baseline")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up there
    exec(compile(src, f"{rev}:hacpo/models/generation.py", "exec"), mod.__dict__)
    return mod


def host_reads(fn) -> int:
    """Device->host reads made by ``fn()`` (see the module docstring)."""
    from torch.profiler import profile

    calls = [0]
    orig = torch.Tensor.tolist

    def counted(self):
        calls[0] += 1
        return orig(self)
    torch.Tensor.tolist = counted
    try:
        with profile() as prof:
            fn()
    finally:
        torch.Tensor.tolist = orig
    return calls[0] + sum(e.name == "aten::_local_scalar_dense" for e in prof.events())


def reads_per_token(mod, policy, prompts, args) -> float:
    """Host reads per decoding step, from two rollouts whose responses never end early (the
    EOS logit of every step is set to -1e9)."""
    eos = policy.tokenizer.eos_id
    stepper_cls = mod._DecoderStepper
    orig_prefill, orig_step = stepper_cls.prefill, stepper_cls.step

    def no_eos(f):
        def g(self, *a):
            out = f(self, *a).clone()
            out[:, eos] = -1e9
            return out
        return g
    stepper_cls.prefill, stepper_cls.step = no_eos(orig_prefill), no_eos(orig_step)
    try:
        counts = {}
        for n in (8, 24):
            counts[n] = host_reads(lambda: mod.generate(
                policy, prompts, num_samples=args.group, max_new_tokens=n,
                temperature=args.temperature, top_p=args.top_p,
                generator=torch.Generator(args.device).manual_seed(0)))
    finally:
        stepper_cls.prefill, stepper_cls.step = orig_prefill, orig_step
    return (counts[24] - counts[8]) / 16


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results_dir", nargs="?")
    ap.add_argument("--baseline", required=True, help="git revision of the baseline")
    ap.add_argument("--reps", type=positive_int, default=7)
    ap.add_argument("--prompts", type=positive_int, default=16)
    ap.add_argument("--group", type=positive_int, default=4)
    ap.add_argument("--max-new-tokens", type=positive_int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        ap.error(f"--temperature must be finite and >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        ap.error(f"--top-p must be in (0, 1], got {args.top_p}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device!r} is not a torch device (cpu, cuda, cuda:1, ...)")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device here")
    if args.results_dir:
        results_dir(ap, args.results_dir)
    torch.set_num_threads(args.threads)
    base = load_baseline(args.baseline)
    versions = {f"baseline ({args.baseline})": base, "current": current}
    policy = build_policy(PolicyConfig(name="tiny", kind="decoder", seed=0)).to(args.device)
    policy.eval()
    prompts = [policy.tokenizer.prompt_ids(QUESTIONS[i % len(QUESTIONS)].format(
        a=3 + 7 * i, b=2 + i)) for i in range(args.prompts)]
    for mod in versions.values():  # warm-up
        mod.generate(policy, prompts[:2], num_samples=2, max_new_tokens=4)

    times = {k: [] for k in versions}
    steps = None
    for r in range(args.reps):
        order = list(versions) if r % 2 == 0 else list(versions)[::-1]
        rollouts = {}
        for k in order:
            g = torch.Generator(args.device).manual_seed(r)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            ro = versions[k].generate(policy, prompts, num_samples=args.group,
                                      max_new_tokens=args.max_new_tokens,
                                      temperature=args.temperature, top_p=args.top_p,
                                      generator=g)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            steps = max(ro.response_lengths)
            times[k].append(dt / steps)
            rollouts[k] = (ro.response_ids, ro.sampler_logprobs)
        a, b = rollouts.values()
        if a != b:
            raise SystemExit(f"repetition {r}: the two versions sampled different rollouts")
    reads = {k: reads_per_token(m, policy, prompts, args) for k, m in versions.items()}

    pcts = percentiles(times)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"device {args.device}, {args.threads} thread(s); tiny decoder "
          f"({sum(p.numel() for p in policy.parameters()) / 1e3:.0f}k params), "
          f"{args.prompts} prompts x G={args.group}, <= {args.max_new_tokens} new tokens, "
          f"temperature {args.temperature}, top_p {args.top_p}, {args.reps} reps; "
          f"rollouts identical")
    for k in versions:
        print(f"  {k:24s} ms/token p20 {1e3 * pcts['p20'][k]:7.3f}  p50 "
              f"{1e3 * pcts['p50'][k]:7.3f}  p80 {1e3 * pcts['p80'][k]:7.3f}   "
              f"host reads/token {reads[k]:g}")
    k0, k1 = versions
    print(f"  p50 current / baseline: {pcts['p50'][k1] / pcts['p50'][k0]:.3f}")
    if args.results_dir:
        with open(os.path.join(args.results_dir, "generation_syncs.json"), "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "seconds_per_token": pcts,
                       "host_reads_per_token": reads, "times": times}, f, indent=1)


if __name__ == "__main__":
    main()
