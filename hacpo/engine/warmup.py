"""Supervised warm-up: teacher-forced next-token loss on reference answers, so RL starts from
agents with different, non-zero accuracy."""
from __future__ import annotations

import math

import torch

from .update import adamw, step_clipped


def supervised_warmup(policy, prompt_ids: list[list[int]], target_ids: list[list[int]], *,
                      steps: int, lr: float, batch_size: int, seed: int, micro_batch: int = 256,
                      progress=None) -> list[float]:
    """``steps`` AdamW steps on random batches of (prompt, target) pairs; token-mean NLL over
    the target tokens (EOS included), gradients clipped to norm 1 (norm in fp32). Returns the
    loss per step. bfloat16 / float16 weights are stepped through fp32 master weights
    (:func:`hacpo.engine.update.adamw`). Non-finite gradients: a RuntimeError, no step."""
    if steps <= 0:
        return []
    if len(prompt_ids) != len(target_ids) or not prompt_ids:
        raise ValueError(f"warm-up needs as many targets as prompts, and at least one (got "
                         f"{len(prompt_ids)} prompts, {len(target_ids)} targets)")
    params = list(policy.parameters())
    opt = adamw(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, steps // 10)) * max(0.1, 1 - s / steps))
    g = torch.Generator().manual_seed(seed)
    was_training = policy.training
    policy.train()
    losses = []
    for step in range(steps):
        idx = torch.randint(len(prompt_ids), (batch_size,), generator=g).tolist()
        opt.zero_grad(set_to_none=True)
        ntok = sum(len(target_ids[i]) for i in idx)
        total = 0.0
        for s in range(0, len(idx), micro_batch):
            part = idx[s:s + micro_batch]
            tl, mask = policy.response_logprobs([prompt_ids[i] for i in part],
                                                [target_ids[i] for i in part])
            loss = -(tl * mask).sum() / ntok
            loss.backward()
            total += float(loss.detach())
        # norm and clip in fp32 (an fp16 norm above 65504 is not an overflow); a non-finite
        # norm takes no step (it would write NaN into every weight)
        norm = float(step_clipped(opt, params, 1.0))
        if not math.isfinite(norm):
            raise RuntimeError(f"warm-up of policy {getattr(policy, 'name', '?')!r}, step {step}: "
                               f"non-finite gradient norm ({norm}; loss {total}); the step was "
                               f"not taken")
        sched.step()
        losses.append(total)
        if progress is not None:
            progress(step, total)
    # RL scores and samples in the mode the policy came in (an HF model's eval mode: no
    # dropout, deterministic log-probs)
    policy.train(was_training)
    return losses
