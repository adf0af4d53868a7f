"""HACPO minibatch loss straight from logits (or hidden + lm_head weight) of a packed minibatch.

    new_lp[s] = mean_{t in seq s} log softmax(logits[t] / temp)[y_t]     (kernels, no [T, V] f32)
    (loss, metrics) = hacpo.engine.hacpo_policy_loss(new_lp, old_lp, A, is_self, omega, ...)

The loss math is not repeated here: it is SPEC's `hacpo_policy_loss` (self GSPO + cross
objective c * sg(c)^alpha * omega * A with the stepwise lower bound lo_m), applied to the kernels'
per-sequence mean log-probs. Gradients flow to logits (or hidden and weight).
"""
from __future__ import annotations

import torch

from hacpo.kernels.fused_linear import fused_linear_token_logprobs
from hacpo.kernels.logprobs import segment_mean, sequence_mean_logprobs
from hacpo.kernels._common import (cu_seqlens_status, raise_if_invalid, shard_status,
                                   token_status, vocab_layout)


def _policy_loss(new_lp, old_lp, advantages, is_self, omega, minibatch_index, divisor,
                 loss_kwargs, entropy):
    from hacpo.engine import hacpo_policy_loss   # torch-only import; kept lazy for import order
    loss, metrics = hacpo_policy_loss(new_lp, old_lp, advantages, is_self, omega,
                                      minibatch_index=minibatch_index, divisor=divisor,
                                      **loss_kwargs)
    if entropy is not None:
        metrics["entropy_mean"] = entropy.mean()
    return loss, metrics


def hacpo_loss_from_logits(logits: torch.Tensor, targets: torch.Tensor, cu_seqlens: torch.Tensor,
                           old_lp: torch.Tensor, advantages: torch.Tensor, is_self: torch.Tensor,
                           omega: torch.Tensor, *, minibatch_index: int, divisor=None,
                           temperature: float = 1.0, backend: str = "auto", tp_group=None,
                           with_entropy: bool = False, validate: bool = True, **loss_kwargs):
    """logits [T, V] (V-shard with tp_group), targets [T], cu_seqlens [S+1], old_lp/advantages/
    is_self/omega [S] -> (loss [], metrics). `loss_kwargs` go to `hacpo_policy_loss` (alpha,
    cross_clip, cross_clip_delta, ...). with_entropy adds metrics["entropy_mean"] (token mean)."""
    out = sequence_mean_logprobs(logits, targets, cu_seqlens, temperature=temperature,
                                 backend=backend, tp_group=tp_group, return_entropy=with_entropy,
                                 validate=validate)
    new_lp, ent = out if with_entropy else (out, None)
    return _policy_loss(new_lp, old_lp, advantages, is_self, omega, minibatch_index, divisor,
                        loss_kwargs, ent)


def hacpo_loss_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           cu_seqlens: torch.Tensor, old_lp: torch.Tensor,
                           advantages: torch.Tensor, is_self: torch.Tensor, omega: torch.Tensor, *,
                           minibatch_index: int, divisor=None, temperature: float = 1.0,
                           chunk_size: int | None = None, backend: str = "auto", tp_group=None,
                           with_entropy: bool = False, validate: bool = True,
                           vocab_size: int | None = None, **loss_kwargs):
    """Same as `hacpo_loss_from_logits` with logits = hidden [T, H] @ weight[V, H].T formed chunk
    by chunk (never a full [T, V]). vocab_size: the real vocabulary of a padded weight (a
    Megatron one: rows past it get probability 0), as in `fused_linear_token_logprobs`."""
    cu_st = cu_seqlens_status(cu_seqlens, hidden.shape[0])    # shape checks are eager
    shard_st = shard_status(weight.shape[0], tp_group, hidden.device) if validate else None
    out = fused_linear_token_logprobs(hidden, weight, targets, temperature=temperature,
                                      chunk_size=chunk_size, backend=backend, tp_group=tp_group,
                                      return_entropy=with_entropy, validate=False,
                                      vocab_size=vocab_size)
    tok, ent = out if with_entropy else (out, None)
    if validate:   # one combined host sync for targets, non-finite rows and cu_seqlens
        _, v_global = vocab_layout(weight.shape[0], tp_group)
        raise_if_invalid(token_status(targets, tok.detach(), vocab_size or v_global),
                         hidden.shape[0], cu_st, cu_seqlens, shard_st=shard_st)
    new_lp = segment_mean(tok, cu_seqlens)
    return _policy_loss(new_lp, old_lp, advantages, is_self, omega, minibatch_index, divisor,
                        loss_kwargs, ent)
