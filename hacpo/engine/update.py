"""M minibatch updates of one learner on its view of the step's pool (SPEC "Minibatches").

Each minibatch is forwarded in micro-batches with the minibatch's global count as the loss
divisor, so gradient accumulation gives exactly the full-minibatch gradient. One host sync per
update decides whether the update is finite; a non-finite update is skipped and reported.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch

from .algorithm import learner_loss, split_minibatches
from .config import AlgorithmConfig
from .losses import low_var_kl
from .pool import LearnerView


class NonFiniteUpdateError(RuntimeError):
    """Too many non-finite updates in a row."""


def _pad(rows: list[torch.Tensor], T: int) -> torch.Tensor:
    out = torch.zeros(len(rows), T)
    for i, r in enumerate(rows):
        out[i, :r.numel()] = r
    return out


def update_learner(algo: AlgorithmConfig, policy, optimizer, view: LearnerView, *,
                   lp_old: torch.Tensor, old_token_logp: list[torch.Tensor],
                   prompt_of_sample: torch.Tensor, generator: torch.Generator, micro_batch: int,
                   grad_clip: float, nonfinite: dict, max_nonfinite: int, ref_policy=None,
                   kl_coef: float = 0.0, ratio_log: dict | None = None,
                   temperature: float = 1.0) -> dict[str, float]:
    """Run the M updates; returns averaged metrics (floats). ``nonfinite`` carries the count of
    consecutive non-finite updates across calls ({"streak": int, "total": int})."""
    M = algo.num_minibatches * algo.minibatch_factor
    n = view.idx.numel()
    sums: dict[str, float] = defaultdict(float)
    if n == 0:
        return {"trained_samples": 0.0}
    mbs = split_minibatches(prompt_of_sample[view.idx], view.is_self, M, algo.minibatch_order,
                            generator)
    params = [p for p in policy.parameters() if p.requires_grad]
    for m, mb in enumerate(mbs):
        optimizer.zero_grad(set_to_none=True)
        mb_list = mb.tolist()
        if algo.token_level:
            divisor = sum(len(view.response_ids[j]) for j in mb_list)
        else:
            divisor = len(mb_list)
        total = torch.zeros(())
        mb_metrics: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(()))
        for s in range(0, len(mb_list), micro_batch):
            js = mb_list[s:s + micro_batch]
            prompts = [view.prompt_ids[j] for j in js]
            resps = [view.response_ids[j] for j in js]
            tl, mask = policy.response_logprobs(prompts, resps, temperature=temperature)
            new_lp = (tl * mask).sum(-1) / mask.sum(-1)
            pool_idx = view.idx[js]
            kwargs = {}
            if algo.token_level:
                kwargs = dict(token_logp=tl, mask=mask,
                              old_token_logp=_pad([old_token_logp[i] for i in pool_idx.tolist()],
                                                  tl.shape[1]))
            loss, met = learner_loss(algo, new_lp=new_lp, old_lp=lp_old[pool_idx],
                                     advantages=view.advantages[js], is_self=view.is_self[js],
                                     omega=view.omega[js], minibatch_index=m, divisor=divisor,
                                     **kwargs)
            if kl_coef > 0 and ref_policy is not None:
                self_rows = view.is_self[js]
                if bool(self_rows.any()):
                    with torch.no_grad():
                        ref_tl, _ = ref_policy.response_logprobs(prompts, resps,
                                                             temperature=temperature)
                    kl = low_var_kl(tl, ref_tl, mask)[self_rows]
                    loss = loss + kl_coef * kl.sum() / divisor
                    mb_metrics["kl"] += kl.detach().sum() / max(len(mb_list), 1)
            loss.backward()
            total = total + loss.detach()
            w = len(js) / len(mb_list)
            for k, v in met.items():
                mb_metrics[k] += v.detach().float() * w
            if ratio_log is not None:
                lr_ = (new_lp.detach() - lp_old[pool_idx]).clamp(-10, 10)
                ratio_log.setdefault("self", []).append(lr_[view.is_self[js]])
                ratio_log.setdefault("cross", []).append(lr_[~view.is_self[js]])
        gnorm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        # the update's one host sync: its loss, grad norm and metrics come over together
        keys = list(mb_metrics)
        vals = torch.stack([total.float(), gnorm.float()]
                           + [mb_metrics[k].float().reshape(()) for k in keys]).tolist()
        if all(map(math.isfinite, vals[:2])):
            optimizer.step()
            nonfinite["streak"] = 0
        else:
            optimizer.zero_grad(set_to_none=True)
            nonfinite["streak"] += 1
            nonfinite["total"] += 1
            sums["skipped_updates"] += 1
            if nonfinite["streak"] >= max_nonfinite:
                raise NonFiniteUpdateError(
                    f"{nonfinite['streak']} non-finite updates in a row for policy "
                    f"{getattr(policy, 'name', '?')!r} (loss={vals[0]}, grad norm="
                    f"{vals[1]}); stopping (max_nonfinite={max_nonfinite})")
            continue
        sums["loss"] += vals[0] / len(mbs)
        sums["grad_norm"] += vals[1] / len(mbs)
        for k, v in zip(keys, vals[2:]):
            sums[k] += v / len(mbs)
    sums["trained_samples"] = float(n)
    sums["trained_self"] = float(view.is_self.sum())
    sums["trained_cross"] = float((~view.is_self).sum())
    return dict(sums)
