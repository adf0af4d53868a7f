"""One code path for every algorithm in SPEC's table: the glue between an ``AlgorithmConfig``
and the pure-tensor math (which never sees a config object).

For a learner k and one step's pool of samples:
    idx, A          = learner_samples(cfg, rewards, prompt, agent, learner=k, ratios)
    minibatches     = split_minibatches(prompt[idx], agent[idx] == k, M, order, generator)
    loss, metrics   = learner_loss(cfg, ..., minibatch_index=m, divisor=len(minibatch))
"""
from __future__ import annotations

import torch

from .advantages import group_advantages, hacpo_advantages
from .config import AlgorithmConfig
from .losses import (grpo_policy_loss, gspo_policy_loss, hacpo_policy_loss,
                     self_cross_ratio_metrics)


def learner_samples(cfg: AlgorithmConfig, rewards: torch.Tensor, prompt: torch.Tensor,
                    agent: torch.Tensor, *, learner: int, ratios: torch.Tensor | None):
    """Which samples learner trains on and their advantages.

    rewards, prompt, agent: [N] for the whole step (all agents). ratios: [n, n] capability
    ratios (ignored unless cfg.name == "hacpo"). Returns (idx [N_k] long, A [N_k]).
    """
    if cfg.shares_samples:
        idx = torch.arange(rewards.numel(), device=rewards.device)
    else:
        idx = (agent == learner).nonzero().flatten()
    r, p, a = rewards[idx], prompt[idx], agent[idx]
    if cfg.name == "hacpo":
        if ratios is None:
            raise ValueError("hacpo needs the capability ratios [n, n] (ratios=None)")
        n = ratios.shape[0]
        rat = ratios if cfg.advantage.capability_baseline else torch.ones(
            n, n, dtype=ratios.dtype, device=ratios.device)
        adv = hacpo_advantages(r, p, a, learner=learner, ratios=rat, eps=cfg.advantage.eps,
                               uniform_guard=cfg.advantage.uniform_guard,
                               binary_guard=cfg.advantage.binary_guard,
                               cross_baseline=cfg.advantage.cross_baseline)
    else:
        adv = group_advantages(r, p, eps=cfg.advantage.eps)
    return idx, adv


def sample_omega(cfg: AlgorithmConfig, agent: torch.Tensor, learner: int,
                 ratios: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor:
    """omega_i = omega[source_i, learner] [N] (ones when the coefficient is switched off)."""
    if cfg.name != "hacpo" or not cfg.loss.capability_coefficient:
        return torch.ones(agent.shape, dtype=dtype, device=agent.device)
    return ratios.to(agent.device)[agent, learner].to(dtype)


def split_minibatches(prompt: torch.Tensor, is_self: torch.Tensor, num_minibatches: int,
                      order: str, generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Split a learner's pool [N] into M index tensors (SPEC "Minibatches").

    mixed: prompts shuffled with ``generator`` and cut into M groups; each minibatch holds all
    self and cross samples of its prompts. self_first: self samples then cross samples (stable
    order), cut into M contiguous pieces. Empty minibatches are dropped.
    """
    if num_minibatches < 1:
        raise ValueError(f"num_minibatches must be >= 1, got {num_minibatches}")
    if order == "mixed":
        uniq, inv = torch.unique(prompt, return_inverse=True)
        perm = torch.randperm(uniq.numel(), generator=generator).to(prompt.device)
        rank = torch.empty_like(perm)
        rank[perm] = torch.arange(perm.numel(), device=prompt.device)
        chunk = rank[inv] * num_minibatches // max(uniq.numel(), 1)   # [N] minibatch of sample
        key = chunk * prompt.numel() + torch.arange(prompt.numel(), device=prompt.device)
        ordered = torch.argsort(key)
        sizes = torch.bincount(chunk, minlength=num_minibatches).tolist()
    elif order == "self_first":
        ordered = torch.argsort((~is_self.bool()).long(), stable=True)
        base, extra = divmod(prompt.numel(), num_minibatches)
        sizes = [base + (1 if i < extra else 0) for i in range(num_minibatches)]
    else:
        raise ValueError(f"unknown minibatch order {order!r}")
    return [mb for mb in torch.split(ordered, sizes) if mb.numel() > 0]


def learner_loss(cfg: AlgorithmConfig, *, new_lp: torch.Tensor, old_lp: torch.Tensor,
                 advantages: torch.Tensor, is_self: torch.Tensor, omega: torch.Tensor,
                 minibatch_index: int, divisor=None, token_logp: torch.Tensor | None = None,
                 old_token_logp: torch.Tensor | None = None, mask: torch.Tensor | None = None):
    """Minibatch loss for the configured algorithm. Sequence-level algorithms use new_lp/old_lp
    [N] (per-sequence mean log-probs); grpo uses token_logp/old_token_logp/mask [N, T] and its
    divisor counts tokens. Returns (loss [], metrics)."""
    L = cfg.loss
    if cfg.name == "grpo":
        if token_logp is None or old_token_logp is None or mask is None:
            raise ValueError("grpo's loss is per token: it needs token_logp, old_token_logp "
                             "and mask [N, T]")
        return grpo_policy_loss(token_logp, old_token_logp, mask, advantages,
                                clip_low=L.grpo_clip_low, clip_high=L.grpo_clip_high,
                                divisor=divisor)
    if cfg.name in ("gspo", "gspo2x", "naive"):
        loss, metrics = gspo_policy_loss(new_lp, old_lp, advantages, clip_low=L.self_clip_low,
                                         clip_high=L.self_clip_high,
                                         max_abs_log_ratio=L.max_abs_log_ratio,
                                         divisor=divisor)
        if cfg.shares_samples:     # naive: one objective, but self and cross ratios apart
            metrics = self_cross_ratio_metrics(new_lp, old_lp, is_self,
                                               clip_low=L.self_clip_low,
                                               clip_high=L.self_clip_high,
                                               max_abs_log_ratio=L.max_abs_log_ratio)
        return loss, metrics
    return hacpo_policy_loss(new_lp, old_lp, advantages, is_self, omega,
                             minibatch_index=minibatch_index, alpha=L.alpha,
                             cross_clip=L.cross_clip, cross_clip_delta=L.cross_clip_delta,
                             cross_clip_step=L.cross_clip_step, self_clip_low=L.self_clip_low,
                             self_clip_high=L.self_clip_high,
                             max_abs_log_ratio=L.max_abs_log_ratio, divisor=divisor)
