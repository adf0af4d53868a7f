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


def agent_streak(nonfinite: dict, name: str) -> int:
    """The streak a policy's next update starts from: the longer of the run's (every agent's
    updates in order) and the policy's own (its updates alone)."""
    return max(nonfinite["streak"], nonfinite.get("agents", {}).get(name, 0))


def _count_nonfinite(nonfinite: dict, max_nonfinite: int, name: str, finite: bool,
                     loss: float, grad_norm: float) -> None:
    """One update's effect on the streaks of non-finite updates: the run's (``streak``: the
    updates of all agents in order) and the policy's own (``agents[name]``: one agent whose
    every update is non-finite while another's are finite never makes the run's streak long);
    raises when either reaches ``max_nonfinite``."""
    # agents' streaks > 0 only ({"streak", "total"} while there is none; older checkpoints
    # hold the run's streak only)
    agents = nonfinite.setdefault("agents", {})
    if finite:
        nonfinite["streak"] = 0
        agents.pop(name, None)
        if not agents:
            del nonfinite["agents"]
        return
    nonfinite["streak"] += 1
    nonfinite["total"] += 1
    agents[name] = agents.get(name, 0) + 1
    count = max(nonfinite["streak"], agents[name])
    if count >= max_nonfinite:
        raise NonFiniteUpdateError(
            f"{count} non-finite updates in a row for policy {name!r}"
            + (" (of its own updates; other agents' between them were finite)"
               if agents[name] > nonfinite["streak"] else "")
            + f" (loss={loss}, grad norm={grad_norm}); stopping (max_nonfinite={max_nonfinite})")


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


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def grad_norm_fp32(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``grads`` (tensors of any shapes) taken as one vector: a 0-dim float32
    tensor (float64 if a gradient is float64) on the first gradient's device; 0 for none.

    Each bfloat16 / float16 tensor's norm is accumulated and returned in float32, and the
    total is taken in float32: in float16 a norm above 65504 is inf (a finite update would
    count as non-finite), in bfloat16 it keeps 8 bits. Without low-precision gradients this
    is ``torch.nn.utils.get_total_norm(grads)``, bit for bit (what ``clip_grad_norm_`` uses)."""
    if not any(g.dtype in _LOW_PRECISION for g in grads):
        return torch.nn.utils.get_total_norm(grads, 2.0)
    dev = grads[0].device
    out_dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float32 if g.dtype in _LOW_PRECISION
                                      else None).to(dev, out_dtype) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor (0-dim, ``norm``'s dtype, at most 1) that brings gradients of norm ``norm``
    to at most ``max_norm``: ``clip_grad_norm_``'s ``min(1, max_norm / (norm + 1e-6))``."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def _scale_grads_(grads: list[torch.Tensor], coef: torch.Tensor | float) -> None:
    """Multiply each gradient by ``coef`` in place, in float32 for bf16 / fp16 gradients (one
    rounding to their dtype; the coefficient is never rounded to it)."""
    coef = torch.as_tensor(coef)
    full: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if g.dtype in _LOW_PRECISION:
            g.copy_(g.float() * coef.to(g.device, torch.float32))
        else:
            full.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), gs in full.items():          # as clip_grad_norm_
        torch._foreach_mul_(gs, coef.to(device, dtype))


def step_clipped(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                 max_norm: float) -> torch.Tensor:
    """Clip the gradients of ``params`` to a total 2-norm of ``max_norm`` (<= 0: no clip)
    and step ``optimizer``; returns the norm before clipping (:func:`grad_norm_fp32`). The
    norm and clip coefficient are float32 whatever the gradients' dtype; a
    :class:`MasterWeightAdamW` applies the coefficient to its fp32 copies of the
    low-precision gradients. A non-finite norm steps nothing (the caller decides)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = grad_norm_fp32(grads)
    if not bool(torch.isfinite(norm)):
        return norm
    _apply_clip_and_step(optimizer, grads, norm, max_norm)
    return norm


def _apply_clip_and_step(optimizer, grads, norm, max_norm) -> None:
    coef = clip_coefficient(norm, max_norm) if max_norm > 0 else None
    if isinstance(optimizer, MasterWeightAdamW):
        optimizer.step(grad_scale=coef)
        return
    if coef is not None:
        _scale_grads_(grads, coef)
    optimizer.step()


class MasterWeightAdamW(torch.optim.AdamW):
    """torch's AdamW stepping fp32 copies ("master weights") of the bfloat16 / float16
    parameters, as megatron's optimizer does for such weights.

    Stepping low-precision weights in place is wrong two ways: in float16 Adam's ``eps`` (1e-8)
    and the squares of small gradients underflow to 0, so a weight with a zero or tiny gradient
    becomes NaN or inf on the first step; in bfloat16 an update smaller than half a weight's
    spacing (lr 1e-4 on a weight of 0.05) rounds back to the weight, so small learning rates
    train nothing. Here the gradients are cast to fp32, the moments and the update live in
    fp32, and each weight gets its master rounded to its own dtype after the step. fp32
    parameters are stepped as they are.

    A weight written by someone else since the last step (a loaded state dict, a weight sync)
    no longer equals its rounded master: its master takes the new value, elementwise, at the
    next step. ``state_dict()`` also holds the master weights (``"master_weights"``, in the
    order of the low-precision parameters), and ``load_state_dict`` restores them; a state
    without them (e.g. of a plain AdamW) takes the masters from the current weights.
    """

    def __init__(self, params, **kwargs):
        params = list(params)
        if any(isinstance(p, dict) for p in params):
            raise TypeError("MasterWeightAdamW takes a list of parameters, not parameter groups")
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []   # (low-precision, master)
        stepped = []
        for p in params:
            if p.dtype in (torch.float16, torch.bfloat16):
                m = p.detach().float().clone().requires_grad_(p.requires_grad)
                self._pairs.append((p, m))
                stepped.append(m)
            else:
                stepped.append(p)
        super().__init__(stepped, **kwargs)
        # the weights' version counters when this optimizer last wrote (or saw) them: only a
        # weight written since (a load_state_dict, a weight sync) is compared with its master
        # (a full elementwise pass with temporaries: not on every step)
        self._seen = [p._version for p, _ in self._pairs]

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: torch.Tensor | float | None = None):
        """One AdamW step. ``grad_scale`` (e.g. a clip coefficient, see
        :func:`clip_coefficient`): every gradient is multiplied by it first, the low-precision
        parameters' on their fp32 copies (no rounding to bf16 / fp16: a clip coefficient of
        1e-5 would put most of an fp16 gradient below its normal range), the fp32 parameters'
        in place."""
        if closure is not None:
            raise ValueError("MasterWeightAdamW.step takes no closure")
        if grad_scale is not None:
            # the stepped fp32 parameters' own gradients (the masters' are set below)
            masters = {id(m) for _, m in self._pairs}
            _scale_grads_([q.grad for g in self.param_groups for q in g["params"]
                           if q.grad is not None and id(q) not in masters], grad_scale)
        for i, (p, m) in enumerate(self._pairs):
            if p._version != self._seen[i]:
                # written elsewhere since: the new values win over the master, elementwise
                # (a write of the same values, e.g. the weights reloaded on resume, keeps it)
                m.copy_(torch.where(p == m.to(p.dtype), m, p.float()))
            m.grad = None if p.grad is None else p.grad.float()
            if m.grad is not None and grad_scale is not None:
                _scale_grads_([m.grad], grad_scale)
        super().step()
        for i, (p, m) in enumerate(self._pairs):
            if m.grad is not None:
                p.copy_(m)
            m.grad = None
            self._seen[i] = p._version

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for p, _ in self._pairs:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def state_dict(self):
        sd = super().state_dict()
        sd["master_weights"] = [m.detach().clone() for _, m in self._pairs]
        return sd

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_weights", None)
        super().load_state_dict(state_dict)
        with torch.no_grad():
            if masters is None:
                for p, m in self._pairs:
                    m.copy_(p)
                return
            if len(masters) != len(self._pairs) or any(
                    tuple(w.shape) != tuple(m.shape) for w, (_, m) in zip(masters, self._pairs)):
                raise ValueError(
                    f"optimizer state holds {len(masters)} master weights "
                    f"{[tuple(w.shape) for w in masters]}, but this optimizer steps "
                    f"{len(self._pairs)} low-precision parameters "
                    f"{[tuple(m.shape) for _, m in self._pairs]}")
            for w, (_, m) in zip(masters, self._pairs):
                m.copy_(w)


def adamw(params, *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
          weight_decay: float = 0.0) -> torch.optim.AdamW:
    """The trainer's AdamW: torch's for fp32 parameters, :class:`MasterWeightAdamW` (fp32
    master weights) where some are bfloat16 / float16."""
    params = list(params)
    cls = (MasterWeightAdamW if any(p.dtype in (torch.float16, torch.bfloat16) for p in params)
           else torch.optim.AdamW)
    return cls(params, lr=lr, betas=betas, weight_decay=weight_decay)


class UpdateMetrics:
    """A learner's metrics over its M updates of a step, pooled as if computed over all their
    samples at once (so they do not depend on how the samples fall into minibatches): a mean
    over some of a minibatch's rows is weighted by how many it had (``self_*`` and ``kl``: self
    rows; ``cross_*`` ratio means and clip fractions: cross rows; ``token_*``: response tokens),
    the counts ``self_count`` / ``cross_count`` are summed, and per-update values (``loss``,
    ``grad_norm``, ``cross_lower_bound``) are averaged over the updates. Only the updates that
    were applied (finite) count. A mean over rows no update had (``cross_ratio_mean`` when every
    cross sample was dropped) is left out of the result, never reported as a made-up 0."""

    SUMMED = ("self_count", "cross_count")
    PER_UPDATE = ("loss", "grad_norm", "cross_lower_bound")

    def __init__(self):
        self.num: dict[str, float] = {}
        self.den: dict[str, float] = {}

    @classmethod
    def weight(cls, key: str, *, n_self: int, n_cross: int, n_tokens: int) -> float | None:
        """A minibatch's weight for metric ``key``; None: summed, not averaged."""
        if key in cls.SUMMED:
            return None
        if key in cls.PER_UPDATE:
            return 1.0
        if key.startswith("self_") or key == "kl":
            return float(n_self)
        if key.startswith("cross_"):
            return float(n_cross)
        if key.startswith("token_"):
            return float(n_tokens)
        return 1.0

    def add(self, metrics: dict[str, float], *, n_self: int, n_cross: int,
            n_tokens: int) -> None:
        """One applied update's metrics (floats) and its minibatch's row and token counts."""
        for key, v in metrics.items():
            w = self.weight(key, n_self=n_self, n_cross=n_cross, n_tokens=n_tokens)
            self.num.setdefault(key, 0.0)
            self.den.setdefault(key, 0.0)
            if w is None:
                self.num[key] += v
            elif w > 0:
                self.num[key] += w * v
                self.den[key] += w

    def result(self) -> dict[str, float]:
        """Summed counts and pooled means; no entry for a mean over no rows."""
        return {key: v if key in self.SUMMED else v / self.den[key]
                for key, v in self.num.items() if key in self.SUMMED or self.den[key] > 0}


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
    its samples (from detached values) and pooled over the applied updates by
    :class:`UpdateMetrics` (means over the step's self / cross rows or tokens, summed counts;
    ``trained_*`` count the view's rows, also those of skipped updates). The result's ``tokens_forward_prompt`` counts the prompt
    tokens forwarded in prompt passes."""
    M = algo.num_minibatches * algo.minibatch_factor
    n = view.idx.numel()
    sums: dict[str, float] = defaultdict(float)
    if n == 0:       # the same count keys as a step with samples (a learner's row keeps them)
        return {"trained_samples": 0.0, "trained_self": 0.0, "trained_cross": 0.0,
                "tokens_forward_prompt": 0.0}
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
    pooled = UpdateMetrics()
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
                m_ = algo.loss.max_abs_log_ratio     # the log_s the loss used (SPEC: +-10)
                lr_ = (new_lp.detach() - lp_old[pool_idx]).clamp(-m_, m_)
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
            # norm and clip coefficient in fp32 whatever the weights' dtype (grad_norm_fp32)
            grads = [p.grad for p in params if p.grad is not None]
            gnorm = grad_norm_fp32(grads)
            # the update's one host sync: its loss, grad norm and metrics come over together
            keys = list(mb_metrics)
            vals = torch.stack([total.float(), gnorm.float()]
                               + [mb_metrics[k].float().reshape(()) for k in keys]).tolist()
            finite = all(map(math.isfinite, vals[:2]))
            if finite:
                _apply_clip_and_step(optimizer, grads, gnorm, grad_clip)
        if trace is not None:
            trace.append({"finite": finite, "loss": vals[0], "grad_norm": vals[1]})
        if not finite:
            optimizer.zero_grad(set_to_none=True)
            sums["skipped_updates"] += 1
        _count_nonfinite(nonfinite, max_nonfinite, getattr(policy, "name", "?"), finite,
                         vals[0], vals[1])
        if not finite:
            continue
        pooled.add({"loss": vals[0], "grad_norm": vals[1], **dict(zip(keys, vals[2:]))},
                   n_self=n_self, n_cross=len(mb_list) - n_self,
                   n_tokens=sum(len(view.response_ids[j]) for j in mb_list))
    sums.update(pooled.result())
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
    whatever the micro-batching), from the detached log-probs of the update. A sample of the
    minibatch without its log-prob (a result lost on the way back from a rank) is an error,
    not a metric over fewer samples."""
    missing = [j for j in mb_list if j not in new_lp_of]
    if missing:
        raise RuntimeError(f"minibatch {m}: no new log-prob for {len(missing)} of its "
                           f"{len(mb_list)} samples (view rows {missing[:8]}): a scoring "
                           f"result was lost")
    js = list(mb_list)
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
