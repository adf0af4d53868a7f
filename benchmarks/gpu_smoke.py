"""GPU smoke run: 2 HACPO steps with two megatron-core TP=1 policies and the Triton log-prob
kernels, per-stage timings into RESULTS_DIR. Called by benchmarks/gpu_smoke.sh (which also
installs a megatron-core wheel when needed).

    PYTHONPATH=<repo root> python benchmarks/gpu_smoke.py RESULTS_DIR [--device cuda|cpu]

Two heterogeneous agents (a Llama and a Qwen2 config, same vocabulary, random weights) are
built with transformers, converted to megatron-core ``GPTModel`` shards
(``hacpo.models.megatron``) and trained with megatron-core's DDP + optimizer. One HACPO step:

    prompts   random token prompts (one batch shared by both agents)
    generate  each agent samples G responses per prompt (plain ancestral sampling through the
              megatron model's logits; no KV cache: a smoke test, not a rollout engine)
    reward    a verifiable rule on the tokens: 1 if most response tokens are in the lower half
              of the vocabulary, else 0
    capability / advantages / minibatches / loss: hacpo.engine's CapabilityTracker,
              learner_samples, sample_omega, split_minibatches, learner_loss (algorithm "hacpo")
    old_logprobs  each generator's own token log-probs of the response tokens
              (MegatronPolicy.token_logprobs with positions, as the trainer scores them)
    update    per learner, M minibatch updates with MegatronPolicy.train_step (response tokens)

Token log-probs (scoring and training) go through the policies' ``lm_head`` (``--lm-head``:
"fused", the default, ``hacpo.kernels.fused_linear_token_logprobs`` on the final hidden states;
"logits", megatron's output layer then ``hacpo.kernels.token_logprobs``), both with
``backend="triton"`` (an error where Triton cannot run, never a fallback). Before training,
each policy's log-probs are checked against its HF model's (torch), the two lm_head paths
against each other, token-budget packing against fixed micro-batches, one step's gradients
with full activation recomputation against those without, one Adam step of megatron's
distributed optimizer against its plain one, and the weights gathered back
through ``megatron_to_hf`` against the HF ones.

Outputs: RESULTS_DIR/timings.json (per step, per stage seconds), RESULTS_DIR/summary.json and
RESULTS_DIR/summary.txt. Exit code 0 only if every check passed.

``--device cpu`` is for testing this script without a GPU: Triton runs under TRITON_INTERPRET=1
at tiny shapes and megatron-core runs with the CUDA-call patches of the *test-only* helper
``tests/megatron/_cpu_megatron.py`` (imported explicitly in this mode only; library code never
patches CUDA).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Sizes: "cuda" is a ~100M-parameter model per agent (a few seconds per step on one GPU);
# "cpu" is tiny because the Triton interpreter is ~100x slower than torch.
SHAPES = {
    "cuda": dict(hidden=768, ffn=2048, layers=8, heads=12, kv_heads=4, vocab=32000,
                 prompts=8, group=4, prompt_len=32, response_len=32, micro=16, minibatches=2),
    "cpu": dict(hidden=64, ffn=96, layers=2, heads=4, kv_heads=2, vocab=96,
                prompts=2, group=2, prompt_len=4, response_len=4, micro=4, minibatches=2),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results_dir")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lm-head", choices=("fused", "logits"), default="fused",
                   help="how the policies turn hidden states into log-probs (MegatronPolicy)")
    p.add_argument("--logprob-tol", type=float, default=None,
                   help="max |megatron - HF| token log-prob before training (default: 1e-4 on "
                        "cpu, 2e-3 on cuda: fp32 with other attention/GEMM kernels)")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg: str) -> None:
    print(f"[gpu_smoke {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- models -----------------------------------------------------------------------------------
def hf_models(shape: dict, seed: int):
    """Two heterogeneous HF causal LMs (Llama, Qwen2) with one vocabulary, random weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
                  num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                  num_key_value_heads=shape["kv_heads"], vocab_size=shape["vocab"],
                  max_position_embeddings=256, rms_norm_eps=1e-6)
    models = {}
    for i, (name, cls, extra) in enumerate((("llama", LlamaConfig, dict(tie_word_embeddings=False)),
                                            ("qwen2", Qwen2Config,
                                             dict(tie_word_embeddings=True,
                                                  rope_theta=1e6)))):
        cfg = cls(**common, **extra)
        cfg._attn_implementation = "eager"
        torch.manual_seed(seed + i)
        models[name] = AutoModelForCausalLM.from_config(cfg).float().eval()
    return models


def sample(policy, prompts, group: int, response_len: int, generator):
    """G responses per prompt by ancestral sampling (temperature 1) from the megatron model's
    logits (TP=1: the full vocabulary). prompts [P, Lp] -> sequences [P*G, Lp+Lr]."""
    import torch

    seqs = prompts.repeat_interleave(group, dim=0)
    model = policy.module
    model.eval()
    with torch.no_grad():
        for _ in range(response_len):
            b, s = seqs.shape
            pos = torch.arange(s, device=seqs.device).expand(b, s)
            logits = model(seqs, pos, attention_mask=None)[:, -1, :].float()
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
            seqs = torch.cat([seqs, nxt], dim=1)
    return seqs


def rewards_of(seqs, prompt_len: int, vocab: int):
    """1.0 if more than half of the response tokens are < vocab/2, else 0.0 ([N] float32)."""
    resp = seqs[:, prompt_len:]
    return ((resp < vocab // 2).float().mean(1) > 0.5).float()


def _micro(rows: int, micro: int) -> int:
    """Micro-batch size: megatron's schedule needs equal micro-batches, so use ``micro`` when it
    divides the minibatch and the whole minibatch otherwise."""
    return micro if rows % micro == 0 else rows


# -- the run ----------------------------------------------------------------------------------
def _one_step(hf_model, par, args, ids, *, optimizer: str, lr: float, recompute=None,
              distributed: bool = False):
    """A fresh policy from ``hf_model`` (``recompute`` as asked, on ``ids``' device) and one
    ``train_step`` on ``ids`` with megatron's ``optimizer`` (``distributed``: its distributed
    optimizer): (policy, the weights before the step on the host). Raises if megatron built
    another recomputation or optimizer than asked."""
    from hacpo.models.megatron import MegatronPolicy
    from hacpo.models.megatron.policy import chained

    pol = MegatronPolicy.from_hf(hf_model, par, logprob_backend="triton", lm_head=args.lm_head,
                                 recompute=recompute)
    if pol.module.config.recompute_granularity != (recompute and recompute["recompute"]):
        raise RuntimeError(f"the policy was built with recompute_granularity="
                           f"{pol.module.config.recompute_granularity!r}, asked {recompute}")
    if ids.device.type == "cuda":
        pol.module.cuda()
    before = {k: p.detach().float().cpu().clone() for k, p in pol.module.named_parameters()}
    opt = pol.build_optimizer(lr=lr, optimizer=optimizer, use_distributed_optimizer=distributed)
    built = {type(o).__name__ for o in chained(opt)}
    want = "DistributedOptimizer" if distributed else "FP32Optimizer"
    if built != {want}:
        raise RuntimeError(f"asked for {want}, megatron built {built}")
    pol.train_step(opt, [{"input_ids": ids[:, :-1], "targets": ids[:, 1:]}],
                   lambda lp, mb: (-lp.mean(), {}))
    return pol, before


def recompute_grad_diff(hf_model, par, args, ids) -> float:
    """One ``train_step`` (SGD, lr 0) on ``ids`` without and with full activation
    recomputation (``parallel.recompute=full``: every layer re-run in the backward, megatron's
    checkpointing and, on CUDA, its RNG tracker): the largest gradient difference over the
    largest gradient."""
    grads = []
    for rc in (None, {"recompute": "full", "num_layers": 1}):
        pol, _ = _one_step(hf_model, par, args, ids, optimizer="sgd", lr=0.0, recompute=rc)
        grads.append({k: p.main_grad.detach().float().cpu()
                      for k, p in pol.module.named_parameters()})
        del pol
    scale = max(float(g.abs().max()) for g in grads[0].values())
    return max(float((grads[1][k] - g).abs().max()) for k, g in grads[0].items()) / scale


def distributed_optimizer_diff(hf_model, par, args, ids) -> float:
    """One ``train_step`` (Adam, lr 1e-3) with megatron's plain optimizer and with its
    distributed optimizer (``parallel.distributed_optimizer``; at DP=1 one slice, but its own
    buffers, reduce-scatter, all-gather and main-parameter copies): the largest difference of
    the updated weights over the largest update."""
    after = []
    for dist_opt in (False, True):
        pol, before = _one_step(hf_model, par, args, ids, optimizer="adam", lr=1e-3,
                                distributed=dist_opt)
        after.append({k: p.detach().float().cpu() for k, p in pol.module.named_parameters()})
        del pol
    scale = max(float((w - before[k]).abs().max()) for k, w in after[0].items())
    if not scale > 0:
        raise RuntimeError("the Adam step did not change the weights")
    return max(float((after[1][k] - w).abs().max()) for k, w in after[0].items()) / scale


def run(args, results: dict, timings: list) -> None:
    import torch
    import torch.distributed as dist

    from hacpo.engine.algorithm import (learner_loss, learner_samples, sample_omega,
                                        split_minibatches)
    from hacpo.engine.capability import CapabilityTracker
    from hacpo.engine.config import AlgorithmConfig
    from hacpo.engine.losses import sequence_mean_logprob
    from hacpo.engine.timing import Stopwatch
    from hacpo.models.megatron import MegatronPolicy, hf_state_dict, init_parallel, \
        require_megatron

    require_megatron()
    import megatron.core

    shape = SHAPES[args.device]
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    results.update(device=args.device, shape=shape, steps=args.steps,
                   megatron_core=megatron.core.__version__, torch=torch.__version__,
                   python=platform.python_version(), logprob_backend="triton",
                   lm_head=args.lm_head,
                   tensor_parallel=1, pipeline_parallel=1, data_parallel=1)
    import triton

    from hacpo.kernels._common import resolve_backend
    results["triton"] = triton.__version__
    # what the policies' backend="triton" resolves to here (raises rather than falling back)
    results["logprob_backend_resolved"] = resolve_backend("triton", dev)
    if dev.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(0)

    t0 = time.perf_counter()
    par = init_parallel(1, 1, seed=args.seed)
    hfs = hf_models(shape, args.seed)
    names = list(hfs)
    policies, optims = [], []
    for name in names:
        pol = MegatronPolicy.from_hf(hfs[name], par, logprob_backend="triton",
                                     lm_head=args.lm_head)
        if dev.type == "cuda":
            pol.module.cuda()
        policies.append(pol)
    results["params"] = {n: sum(p.numel() for p in hfs[n].parameters()) for n in names}
    results["time_build_s"] = time.perf_counter() - t0
    log(f"built {names} ({results['params']}) in {results['time_build_s']:.1f} s")

    # checks before training: weights round-trip, log-probs == HF (torch) log-probs
    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    V, Lp, Lr = shape["vocab"], shape["prompt_len"], shape["response_len"]
    probe = torch.randint(0, V, (4, Lp + Lr), generator=g)
    tol = args.logprob_tol if args.logprob_tol is not None else \
        (1e-4 if dev.type == "cpu" else 2e-3)
    checks = results.setdefault("checks", {})
    before = {}
    for name, pol in zip(names, policies):
        ref = hf_state_dict(hfs[name])
        back = pol.hf_state_dict()
        same = back.keys() == ref.keys() and all(torch.equal(back[k].cpu(), ref[k]) for k in ref)
        checks[f"{name}/weights_roundtrip_exact"] = bool(same)
        hf = hfs[name].to(dev)
        ids = probe.to(dev)
        with torch.no_grad():
            lg = hf(input_ids=ids[:, :-1]).logits.float()
            hf_lp = torch.log_softmax(lg, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        lp = pol.token_logprobs(ids[:, :-1], ids[:, 1:])
        err = float((lp - hf_lp).abs().max())
        results.setdefault("logprob_max_abs_err_vs_hf", {})[name] = err
        checks[f"{name}/logprobs_match_hf"] = err <= tol
        other = "logits" if args.lm_head == "fused" else "fused"
        pol.lm_head = other                      # the other path on the same shard
        lp_other = pol.token_logprobs(ids[:, :-1], ids[:, 1:])
        pol.lm_head = args.lm_head
        err_heads = float((lp - lp_other).abs().max())
        results.setdefault("logprob_max_abs_diff_lm_heads", {})[name] = err_heads
        checks[f"{name}/lm_heads_agree"] = err_heads <= tol
        # parallel.micro_batch_tokens' packing: a budget of 3 rows' tokens packs the 4 probe
        # rows into 2 micro-batches of 3 rows and 1; the result comes back in row order
        lp_tok = pol.token_logprobs(ids[:, :-1], ids[:, 1:], micro_batch_size=4,
                                    micro_batch_tokens=3 * (ids.shape[1] - 1))
        err_tok = float((lp - lp_tok).abs().max())
        results.setdefault("logprob_max_abs_diff_token_budget", {})[name] = err_tok
        checks[f"{name}/token_budget_agrees"] = err_tok <= tol
        err_rc = recompute_grad_diff(hf, par, args, ids)
        results.setdefault("grad_max_rel_diff_recompute", {})[name] = err_rc
        checks[f"{name}/recompute_agrees"] = err_rc <= (1e-5 if dev.type == "cpu" else 1e-3)
        err_do = distributed_optimizer_diff(hf, par, args, ids)
        results.setdefault("weight_max_rel_diff_distributed_optimizer", {})[name] = err_do
        checks[f"{name}/distributed_optimizer_agrees"] = err_do <= (1e-5 if dev.type == "cpu"
                                                                      else 1e-3)
        hfs[name] = hf.cpu()
        before[name] = {k: v.detach().cpu().clone() for k, v in back.items()}
        log(f"{name}: weights round-trip {'exact' if same else 'DIFFER'}; "
            f"|lp - hf| = {err:.2e} (tol {tol:g})")
    del hfs
    for pol in policies:
        optims.append(pol.build_optimizer(lr=args.lr, optimizer="adam"))

    cfg = AlgorithmConfig(name="hacpo", num_minibatches=shape["minibatches"])
    n = len(policies)
    tracker = CapabilityTracker(n, **vars(cfg.capability))
    shuffle = torch.Generator().manual_seed(args.seed + 7)
    gen = torch.Generator(device=dev).manual_seed(args.seed + 3)
    P, G = shape["prompts"], shape["group"]
    losses_finite = True
    for step in range(args.steps):
        sw = Stopwatch(sync)
        t_step = time.perf_counter()
        prompts = torch.randint(0, V, (P, Lp), generator=g).to(dev)
        seqs, agent = [], []
        for k, name in enumerate(names):
            with sw(f"generate/{name}"):
                seqs.append(sample(policies[k], prompts, G, Lr, gen))
            agent.append(torch.full((P * G,), k, dtype=torch.long))
        seqs = torch.cat(seqs)                                       # [N, Lp+Lr]
        agent = torch.cat(agent)
        prompt = torch.arange(P).repeat_interleave(G).repeat(n)      # [N]
        with sw("reward"):
            rewards = rewards_of(seqs, Lp, V).cpu()
        with sw("capability"):
            tracker.update(rewards, agent)
            ratios = tracker.ratios()
        inputs, targets = seqs[:, :-1], seqs[:, 1:]
        N = seqs.shape[0]
        # the response tokens only: predicted at positions Lp-1 .. Lp+Lr-2 (all real here)
        resp_pos = torch.arange(Lp - 1, Lp - 1 + Lr).expand(N, Lr)
        mask = torch.ones(N, Lr, dtype=torch.bool)
        old_tok = torch.empty(N, Lr, dtype=torch.float32)
        for k, name in enumerate(names):                              # each generator's own lp
            rows = (agent == k).nonzero().flatten()
            with sw(f"old_logprobs/{name}"):
                old_tok[rows] = policies[k].token_logprobs(
                    inputs[rows.to(dev)], targets[rows.to(dev)], positions=resp_pos[rows],
                    mask=mask[rows],
                    micro_batch_size=_micro(rows.numel(), shape["micro"])).cpu()
        lp_old = sequence_mean_logprob(old_tok, mask)
        step_metrics = {}
        for k, name in enumerate(names):
            with sw(f"advantages/{name}"):
                idx, adv = learner_samples(cfg, rewards, prompt, agent, learner=k,
                                           ratios=ratios)
                omega = sample_omega(cfg, agent[idx], k, ratios)
                is_self = agent[idx] == k
                mbs = split_minibatches(prompt[idx], is_self, cfg.num_minibatches,
                                        cfg.minibatch_order, shuffle)
            with sw(f"update/{name}"):
                for m, sel in enumerate(mbs):
                    rows = idx[sel]
                    mb_size = _micro(rows.numel(), shape["micro"])
                    divisor = float(rows.numel())          # the global count of the minibatch

                    def loss_fn(lp, mb, m=m):
                        new_lp = sequence_mean_logprob(lp, mb["mask"])
                        loss, _ = learner_loss(cfg, new_lp=new_lp, old_lp=mb["old_lp"],
                                               advantages=mb["adv"], is_self=mb["is_self"],
                                               omega=mb["omega"], minibatch_index=m,
                                               divisor=divisor)
                        return loss, {"loss": loss.detach()}

                    micro = []
                    for lo in range(0, rows.numel(), mb_size):
                        r, s_ = rows[lo:lo + mb_size], sel[lo:lo + mb_size]
                        micro.append({"input_ids": inputs[r.to(dev)],
                                      "targets": targets[r.to(dev)],
                                      "positions": resp_pos[r], "positions_mask": mask[r],
                                      "mask": mask[r].to(dev), "old_lp": lp_old[r].to(dev),
                                      "adv": adv[s_].to(dev), "is_self": is_self[s_].to(dev),
                                      "omega": omega[s_].to(dev)})
                    out = policies[k].train_step(optims[k], micro, loss_fn)
                    loss = sum(float(o["loss"]) for o in out)   # already / global count
                    losses_finite &= all(torch.isfinite(o["logprobs"]).all().item()
                                          for o in out)
                    step_metrics.setdefault(f"loss/{name}", []).append(loss)
        rec = {"step": step, **{f"time/{key}": v for key, v in sw.items()},
               "time/step": time.perf_counter() - t_step,
               "reward_mean": {name: float(rewards[agent == k].mean())
                               for k, name in enumerate(names)},
               "capability_ratios": ratios.tolist(), **step_metrics}
        timings.append(rec)
        log(f"step {step}: {rec['time/step']:.2f} s, rewards {rec['reward_mean']}")

    checks["losses_and_logprobs_finite"] = bool(losses_finite)
    for name, pol in zip(names, policies):
        after = pol.hf_state_dict()
        delta = max(float((after[k].cpu() - before[name][k]).abs().max()) for k in after)
        finite = all(bool(torch.isfinite(v).all()) for v in after.values())
        results.setdefault("max_weight_change", {})[name] = delta
        checks[f"{name}/weights_changed_and_finite"] = bool(delta > 0 and finite)
    dist.barrier()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        # before triton is first imported (ENVIRONMENT.md: Triton on CPU only interpreted)
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.get("TRITON_INTERPRET"):
        print("gpu_smoke: unset TRITON_INTERPRET for --device cuda (compiled kernels are the "
              "point)", file=sys.stderr)
        return 2
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import contextlib

    import torch
    import torch.distributed as dist

    torch.manual_seed(args.seed)
    os.makedirs(args.results_dir, exist_ok=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        print(f"gpu_smoke: megatron-core is not importable ({e}); run benchmarks/gpu_smoke.sh "
              "with --megatron-wheel PATH or install megatron-core==0.16.1", file=sys.stderr)
        return 2
    if args.device == "cpu":
        torch.set_num_threads(1)
        # TEST-ONLY: megatron-core hard-codes a few CUDA calls; the test helper maps them to CPU
        from tests.megatron._cpu_megatron import cpu_patches
        patches, backend = cpu_patches(), "gloo"
    else:
        patches, backend = contextlib.nullcontext(), "nccl"
        torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    results: dict = {"checks": {}}
    timings: list = []
    t0 = time.perf_counter()
    ok = False
    try:
        dist.init_process_group(backend, rank=0, world_size=1)
        with patches:
            run(args, results, timings)
        ok = bool(results["checks"]) and all(results["checks"].values())
    except Exception:
        results["error"] = traceback.format_exc()
        print(results["error"], file=sys.stderr)
    finally:
        try:
            from megatron.core import parallel_state
            parallel_state.destroy_model_parallel()
        except Exception:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()
    results["time_total_s"] = time.perf_counter() - t0
    results["ok"] = ok
    with open(os.path.join(args.results_dir, "timings.json"), "w") as f:
        json.dump(timings, f, indent=2)
    with open(os.path.join(args.results_dir, "summary.json"), "w") as f:
        json.dump(results, f, indent=2)
    lines = [f"gpu_smoke: {'PASS' if ok else 'FAIL'} on {args.device} "
             f"({results.get('gpu', platform.processor() or 'cpu')}) in "
             f"{results['time_total_s']:.1f} s",
             f"megatron-core {results.get('megatron_core')} torch {results.get('torch')} "
             f"triton {results.get('triton')} python {results.get('python')}"]
    lines += [f"check {k}: {'ok' if v else 'FAILED'}" for k, v in results["checks"].items()]
    for rec in timings:
        stages = ", ".join(f"{k[5:]} {v:.3f}s" for k, v in rec.items()
                           if k.startswith("time/") and k != "time/step")
        lines.append(f"step {rec['step']}: {rec['time/step']:.3f} s ({stages})")
    if "error" in results:
        lines.append("error: " + results["error"].strip().splitlines()[-1])
    with open(os.path.join(args.results_dir, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
