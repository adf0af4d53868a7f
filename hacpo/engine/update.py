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
from .losses import kl_numerator, low_var_kl
from .pool import LearnerView
from .timing import null_timer


class NonFiniteUpdateError(RuntimeError):
    """Too many non-finite updates in a row."""


def _count_nonfinite(nonfinite: dict, max_nonfinite: int, name: str, finite: bool,
                     loss: float, grad_norm: float) -> None:
    """One update's effect on the streak of non-finite updates; raises at ``max_nonfinite``
    in a row."""
    if finite:
        nonfinite["streak"] = 0
        return
    nonfinite["streak"] += 1
    nonfinite["total"] += 1
    if nonfinite["streak"] >= max_nonfinite:
        raise NonFiniteUpdateError(
            f"{nonfinite['streak']} non-finite updates in a row for policy {name!r} "
            f"(loss={loss}, grad norm={grad_norm}); stopping (max_nonfinite={max_nonfinite})")


def replay_nonfinite(trace: list[dict], nonfinite: dict, max_nonfinite: int,
                     name: str) -> None:
    """Count an agent's updates, run elsewhere from a streak of 0 (``trace``: each update's
    ``finite``, ``loss``, ``grad_norm``, see :func:`update_learner`), into the run's
    ``nonfinite`` counters as if it had run after the agents before it: the same counts, and
    :class:`NonFiniteUpdateError` at the same update (the trace ends at or after it: its own
    streak is never longer than the run's)."""
    for t in trace:
        _count_nonfinite(nonfinite, max_nonfinite, name, t["finite"], t["loss"],
                         t["grad_norm"])


def _pad(rows: list[torch.Tensor], T: int) -> torch.Tensor:
    out = torch.zeros(len(rows), T)
    for i, r in enumerate(rows):
        out[i, :r.numel()] = r
    return out


def update_learner(algo: AlgorithmConfig, policy, optimizer, view: LearnerView, *,
                   lp_old: torch.Tensor, old_token_logp: list[torch.Tensor],
                   prompt_of_sample: torch.Tensor | None, generator: torch.Generator | None,
                   micro_batch: int,
                   grad_clip: float, nonfinite: dict, max_nonfinite: int, ref_policy=None,
                   kl_coef: float = 0.0, ratio_log: dict | None = None,
                   temperature: float = 1.0, timer=null_timer,
                   minibatches: list[torch.Tensor] | None = None,
                   trace: list[dict] | None = None) -> dict[str, float]:
    """Run the M updates; returns averaged metrics (floats). ``nonfinite`` carries the count of
    consecutive non-finite updates across calls ({"streak": int, "total": int}).

    ``minibatches``: the M minibatches (rows of ``view``) as drawn by ``split_minibatches`` from
    ``generator`` elsewhere (e.g. by the driver, so agents can update at once); then
    ``generator`` and ``prompt_of_sample`` are not used. ``trace``: each update's ``finite``,
    ``loss`` and ``grad_norm`` are appended to it (for :func:`replay_nonfinite`).

    Self and cross samples are forwarded in separate passes so their costs are accounted
    apart: ``timer(key)`` is entered for "score_self", "score_cross" (forward + loss),
    "backward_self", "backward_cross" and "optimizer" (clip, host sync, step). A policy with
    prompt states (the plain decoder, HF llama/qwen2/gpt2; ``share_prompts``) forwards each micro-batch's prompts once
    for both parts ("score_prompt") and backpropagates through them once ("backward_prompt"), so
    cross samples cost only their responses; other policies run self and cross micro-batches
    of whole sequences. The loss is a sum over samples divided by the minibatch's global count,
    so the split leaves the gradient unchanged. Metrics are computed once per minibatch over all
    its samples (from detached values). The result's ``tokens_forward_prompt`` counts the prompt
    tokens forwarded in prompt passes."""
    M = algo.num_minibatches * algo.minibatch_factor
    n = view.idx.numel()
    sums: dict[str, float] = defaultdict(float)
    if n == 0:
        return {"trained_samples": 0.0}
    if minibatches is None:
        if generator is None or prompt_of_sample is None:
            raise ValueError("update_learner needs generator and prompt_of_sample to draw the "
                             "minibatches, or the drawn minibatches")
        mbs = split_minibatches(prompt_of_sample[view.idx], view.is_self, M,
                                algo.minibatch_order, generator)
    else:
        mbs = [torch.as_tensor(mb, dtype=torch.long) for mb in minibatches]
    params = [p for p in policy.parameters() if p.requires_grad]
    is_self = view.is_self.tolist()
    shared = bool(getattr(policy, "share_prompts", False)
                  and getattr(policy, "supports_prompt_states", False))
    prompt_tokens = 0
    for m, mb in enumerate(mbs):
        optimizer.zero_grad(set_to_none=True)
        mb_list = mb.tolist()
        if algo.token_level:
            divisor = sum(len(view.response_ids[j]) for j in mb_list)
        else:
            divisor = len(mb_list)
        total = torch.zeros(())
        kl_sum = torch.zeros(())
        new_lp_of: dict[int, torch.Tensor] = {}      # sample -> detached mean log-prob
        tl_of: dict[int, torch.Tensor] = {}          # sample -> detached token log-probs (grpo)

        def score(part: str, js: list[int], logprobs) -> None:
            """Forward + loss of rows ``js`` (all self or all cross) and their backward;
            ``logprobs(prompts, resps)`` -> (token_logp, mask)."""
            nonlocal total, kl_sum
            prompts = [view.prompt_ids[j] for j in js]
            resps = [view.response_ids[j] for j in js]
            pool_idx = view.idx[js]
            with timer(f"score_{part}"):
                tl, mask = logprobs(prompts, resps)
                new_lp = (tl * mask).sum(-1) / mask.sum(-1)
                kwargs = {}
                if algo.token_level:
                    kwargs = dict(token_logp=tl, mask=mask, old_token_logp=_pad(
                        [old_token_logp[i] for i in pool_idx.tolist()], tl.shape[1]))
                loss, _ = learner_loss(algo, new_lp=new_lp, old_lp=lp_old[pool_idx],
                                       advantages=view.advantages[js],
                                       is_self=view.is_self[js], omega=view.omega[js],
                                       minibatch_index=m, divisor=divisor, **kwargs)
                if kl_coef > 0 and ref_policy is not None and part == "self":
                    with torch.no_grad():
                        ref_tl, _ = ref_policy.response_logprobs(prompts, resps,
                                                                 temperature=temperature)
                    kl = low_var_kl(tl, ref_tl, mask)
                    loss = loss + kl_coef * kl_numerator(kl, mask, algo.token_level) / divisor
                    kl_sum = kl_sum + kl.detach().sum()
            with timer(f"backward_{part}"):
                if loss.requires_grad:
                    loss.backward()
            total = total + loss.detach()
            for r, j in enumerate(js):
                new_lp_of[j] = new_lp[r].detach()
                if algo.token_level:
                    tl_of[j] = tl[r, :len(view.response_ids[j])].detach()
            if ratio_log is not None:
                lr_ = (new_lp.detach() - lp_old[pool_idx]).clamp(-10, 10)
                ratio_log.setdefault(part, []).append(lr_)

        def full_sequences(prompts, resps):
            return policy.response_logprobs(prompts, resps, temperature=temperature)

        for js_all in _micro_batches(view, mb_list, micro_batch, by_prompt=shared):
            if not shared:                      # one part per micro-batch, whole sequences
                score("self" if is_self[js_all[0]] else "cross", js_all, full_sequences)
                continue
            # the micro-batch's prompts are forwarded once for its self and cross rows: their
            # states become leaves, each part's backward stops there, and the prompts'
            # backward runs once on the summed gradient (same gradient as whole sequences)
            keys: dict[tuple, int] = {}
            for j in js_all:
                keys.setdefault(tuple(view.prompt_ids[j]), len(keys))
            with timer("score_prompt"):
                states = policy.encode_prompts(list(keys))
                leaves = states.detached()
            prompt_tokens += sum(len(k) for k in keys)
            for part in ("self", "cross"):
                js = [j for j in js_all if is_self[j] == (part == "self")]
                for s in range(0, len(js), micro_batch):
                    score(part, js[s:s + micro_batch], lambda prompts, resps:
                          policy.continuation_logprobs(leaves, [keys[tuple(p)] for p in prompts],
                                                       resps, temperature=temperature))
            with timer("backward_prompt"):
                states.backward_from(leaves)
            del states, leaves
        mb_metrics = _minibatch_metrics(algo, view, mb_list, new_lp_of, tl_of, lp_old,
                                        old_token_logp, m, divisor)
        n_self = sum(is_self[j] for j in mb_list)
        if kl_coef > 0 and ref_policy is not None and n_self:
            mb_metrics["kl"] = kl_sum / n_self
        with timer("optimizer"):
            gnorm = torch.nn.utils.clip_grad_norm_(
                params, grad_clip if grad_clip > 0 else float("inf"))
            # the update's one host sync: its loss, grad norm and metrics come over together
            keys = list(mb_metrics)
            vals = torch.stack([total.float(), gnorm.float()]
                               + [mb_metrics[k].float().reshape(()) for k in keys]).tolist()
            finite = all(map(math.isfinite, vals[:2]))
            if finite:
                optimizer.step()
        if trace is not None:
            trace.append({"finite": finite, "loss": vals[0], "grad_norm": vals[1]})
        if not finite:
            optimizer.zero_grad(set_to_none=True)
            sums["skipped_updates"] += 1
        _count_nonfinite(nonfinite, max_nonfinite, getattr(policy, "name", "?"), finite,
                         vals[0], vals[1])
        if not finite:
            continue
        sums["loss"] += vals[0] / len(mbs)
        sums["grad_norm"] += vals[1] / len(mbs)
        for k, v in zip(keys, vals[2:]):
            sums[k] += v / len(mbs)
    sums["trained_samples"] = float(n)
    sums["tokens_forward_prompt"] = float(prompt_tokens)
    sums["trained_self"] = float(view.is_self.sum())
    sums["trained_cross"] = float((~view.is_self).sum())
    return dict(sums)


def _micro_batches(view: LearnerView, rows: list[int], micro_batch: int, *,
                   by_prompt: bool) -> list[list[int]]:
    """Split a minibatch's rows into micro-batches, prompts ordered by length (little padding).

    by_prompt: blocks of whole prompt groups, self and cross rows together, of at most
    ``micro_batch`` rows or one group (the block's prompts are forwarded once for both parts;
    the caller runs each part of a block in row chunks of ``micro_batch``); else self rows first, then cross rows, the rows of one prompt adjacent (the
    policy forwards a prompt shared within a call once)."""
    def key(j):
        return (len(view.prompt_ids[j]), tuple(view.prompt_ids[j]), len(view.response_ids[j]))

    is_self = view.is_self.tolist()
    if not by_prompt:
        out = []
        for part in (True, False):
            part_rows = sorted((j for j in rows if is_self[j] == part), key=key)
            out += [part_rows[s:s + micro_batch] for s in range(0, len(part_rows), micro_batch)]
        return out
    groups: dict[tuple, list[int]] = {}
    for j in sorted(rows, key=key):
        groups.setdefault(tuple(view.prompt_ids[j]), []).append(j)
    out, cur = [], []
    for g in groups.values():
        if cur and len(cur) + len(g) > micro_batch:
            out.append(cur)
            cur = []
        cur = cur + g
    if cur:
        out.append(cur)
    return out


@torch.no_grad()
def _minibatch_metrics(algo: AlgorithmConfig, view: LearnerView, mb_list: list[int],
                       new_lp_of: dict, tl_of: dict, lp_old: torch.Tensor,
                       old_token_logp: list[torch.Tensor], m: int, divisor) -> dict:
    """The loss's metrics over the whole minibatch at once (means over the right subsets,
    whatever the micro-batching), from the detached log-probs of the update."""
    js = [j for j in mb_list if j in new_lp_of]
    pool_idx = view.idx[js]
    kwargs = {}
    if algo.token_level:
        T = max(len(tl_of[j]) for j in js)
        tl = _pad([tl_of[j] for j in js], T)
        mask = torch.zeros(len(js), T, dtype=torch.bool)
        for r, j in enumerate(js):
            mask[r, :len(tl_of[j])] = True
        kwargs = dict(token_logp=tl, mask=mask,
                      old_token_logp=_pad([old_token_logp[i] for i in pool_idx.tolist()], T))
    _, met = learner_loss(algo, new_lp=torch.stack([new_lp_of[j] for j in js]),
                          old_lp=lp_old[pool_idx], advantages=view.advantages[js],
                          is_self=view.is_self[js], omega=view.omega[js], minibatch_index=m,
                          divisor=divisor, **kwargs)
    return dict(met)
