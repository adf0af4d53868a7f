"""Policy losses (SPEC "Sequence ratio", "Per-sample objective"): pure tensors, no config.

Every loss returns ``(loss, metrics)``: ``loss = -sum(obj) / divisor`` where ``divisor`` defaults
to the number of samples (tokens for GRPO) held here. Pass the global count of the minibatch as
``divisor`` and sum the losses (or all-reduce the gradients) across micro-batches/ranks: the
result does not depend on the split. Metrics are detached tensors (no host sync).
"""
from __future__ import annotations

import numbers

import torch

from . import defaults as D
from .validation import check_same_length, check_same_shape


def sequence_mean_logprob(token_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean log-prob over each row's response tokens.

    token_logp: [B, T] float; mask: [B, T] bool/0-1 (which tokens count; the final EOS is
    excluded by the caller per SPEC). Returns [B]. A row with no token is an error. What lies
    under the mask is never read (padding may be -inf or NaN).
    """
    check_same_shape(token_logp=token_logp, mask=mask)
    if token_logp.dim() != 2:
        raise ValueError(f"token_logp must be [B, T], got shape {tuple(token_logp.shape)}")
    m = mask.bool() if mask.dtype == torch.bool else mask != 0
    # sums in float32 at least: a half-precision sum of a long response overflows (3000 tokens
    # at -30 is -inf in float16) and its token count rounds past 2048
    acc = torch.promote_types(token_logp.dtype, torch.float32)
    count = m.sum(dim=-1, dtype=acc)
    empty = count == 0
    if bool(empty.any()):
        rows = empty.nonzero().flatten()
        raise ValueError(f"sequence {int(rows[0])} has no tokens in its mask ({rows.numel()} empty "
                         f"of {count.numel()}): an empty response cannot be scored")
    return (torch.where(m, token_logp, 0).sum(dim=-1, dtype=acc) / count).to(token_logp.dtype)


def _divide(total: torch.Tensor, divisor, default) -> torch.Tensor:
    """total / divisor (None: ``default``). A number (numpy's too) or a CPU tensor must be one
    finite value > 0; a device tensor's value is not checked (that would be a host sync)."""
    d = default if divisor is None else divisor
    if torch.is_tensor(d):
        if d.numel() != 1 or d.dtype == torch.bool:
            raise ValueError(f"loss divisor must be one count, got a {d.dtype} tensor of shape "
                             f"{tuple(d.shape)}")
        d = d.reshape(())           # a [1] count keeps the loss a scalar []
        value = float(d) if d.device.type == "cpu" else 1.0
    elif isinstance(d, bool):
        raise TypeError(f"loss divisor must be a number or a one-element tensor, got {d!r}")
    elif isinstance(d, numbers.Real):
        value = float(d)
    else:
        raise TypeError(f"loss divisor must be a number or a one-element tensor, got "
                        f"{type(d).__name__}")
    if not 0 < value < float("inf"):
        raise ValueError(f"loss divisor must be finite and > 0 (an empty minibatch has no "
                         f"loss), got {value:g}")
    return total / d


# what each clip setting must be: a negative width, a low bound reaching 0 (clip_low >= 1) or a
# ratio clamp <= 0 would silently pin or flip the ratios
_CLIP_RULES = {"clip_low": ("in [0, 1)", lambda v: 0 <= v < 1),
               "self_clip_low": ("in [0, 1)", lambda v: 0 <= v < 1),
               "cross_clip_delta": ("in [0, 1]", lambda v: 0 <= v <= 1),
               "cross_clip_step": ("finite and >= 0", lambda v: 0 <= v < float("inf")),
               "max_abs_log_ratio": ("finite and > 0", lambda v: 0 < v < float("inf"))}


def _check_clip(**settings: float) -> None:
    """A clip setting outside its range is an error naming it (others: >= 0, e.g. clip_high)."""
    for name, v in settings.items():
        need, ok = _CLIP_RULES.get(name, (">= 0", lambda v: v >= 0))
        if not ok(v):                     # NaN fails every comparison
            raise ValueError(f"{name} must be {need}, got {v!r}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1)


def sequence_ratio(new_lp: torch.Tensor, old_lp: torch.Tensor,
                   max_abs_log_ratio: float = D.MAX_ABS_LOG_RATIO) -> torch.Tensor:
    """s = exp(clamp(new_lp - old_lp, -max, max)): [N] (or [B, T] per token); grad to new_lp."""
    return torch.exp((new_lp - old_lp).clamp(-max_abs_log_ratio, max_abs_log_ratio))


def gspo_objective(s: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                   clip_high: float) -> torch.Tensor:
    """Per-sample pessimistic clipped objective min(s*A, clip(s, 1-lo, 1+hi)*A) [N]."""
    return torch.minimum(s * advantages, s.clamp(1 - clip_low, 1 + clip_high) * advantages)


def cross_lower_bound(cross_clip: str, minibatch_index: int, delta: float, step: float) -> float:
    """Lower clip bound of the cross ratio: stepwise lo_m = min(1, 1 - delta + m*step),
    static 1 - delta, none -inf (no clipping)."""
    if cross_clip == "stepwise":
        return min(1.0, 1.0 - delta + minibatch_index * step)
    if cross_clip == "static":
        return 1.0 - delta
    if cross_clip == "none":
        return -float("inf")
    raise ValueError(f"unknown cross_clip {cross_clip!r}; choose one of {D.CROSS_CLIPS}")


def gspo_policy_loss(new_lp: torch.Tensor, old_lp: torch.Tensor, advantages: torch.Tensor, *,
                     clip_low: float = D.SELF_CLIP_LOW, clip_high: float = D.SELF_CLIP_HIGH,
                     max_abs_log_ratio: float = D.MAX_ABS_LOG_RATIO, divisor=None):
    """GSPO: sequence ratio, clip [1-clip_low, 1+clip_high], sequence-mean loss.

    new_lp, old_lp: [N] per-sequence mean token log-probs (current / generating policy);
    advantages: [N]. Returns (loss [], metrics).
    """
    n = check_same_length(new_lp=new_lp, old_lp=old_lp, advantages=advantages)
    _check_clip(clip_low=clip_low, clip_high=clip_high, max_abs_log_ratio=max_abs_log_ratio)
    s = sequence_ratio(new_lp, old_lp, max_abs_log_ratio)
    obj = gspo_objective(s, advantages, clip_low, clip_high)
    loss = -_divide(obj.sum(), divisor, n)
    with torch.no_grad():
        sd = s.detach()
        clipped = (sd < 1 - clip_low) | (sd > 1 + clip_high)
        ones = torch.ones_like(sd, dtype=torch.bool)
        metrics = {"self_ratio_mean": _masked_mean(sd, ones),
                   "self_clip_frac": _masked_mean(clipped.to(sd.dtype), ones)}
    return loss, metrics


@torch.no_grad()
def self_cross_ratio_metrics(new_lp: torch.Tensor, old_lp: torch.Tensor, is_self: torch.Tensor,
                             *, clip_low: float = D.SELF_CLIP_LOW,
                             clip_high: float = D.SELF_CLIP_HIGH,
                             max_abs_log_ratio: float = D.MAX_ABS_LOG_RATIO) -> dict:
    """GSPO's ratio metrics reported apart for self and cross rows, for a GSPO objective over
    both (naive): new_lp, old_lp [N], is_self [N] bool. Mean ratio and fraction outside
    [1-clip_low, 1+clip_high] of each part (0 for a part with no rows; see its count), and the
    counts. Detached tensors."""
    check_same_length(new_lp=new_lp, old_lp=old_lp, is_self=is_self)
    is_self = is_self.bool()
    cross = ~is_self
    s = sequence_ratio(new_lp.detach(), old_lp, max_abs_log_ratio)
    clipped = ((s < 1 - clip_low) | (s > 1 + clip_high)).to(s.dtype)
    return {"self_ratio_mean": _masked_mean(s, is_self),
            "cross_ratio_mean": _masked_mean(s, cross),
            "self_clip_frac": _masked_mean(clipped, is_self),
            "cross_clip_frac": _masked_mean(clipped, cross),
            "self_count": is_self.sum(), "cross_count": cross.sum()}


def hacpo_policy_loss(new_lp: torch.Tensor, old_lp: torch.Tensor, advantages: torch.Tensor,
                      is_self: torch.Tensor, omega: torch.Tensor, *, minibatch_index: int,
                      alpha: float = D.ALPHA, cross_clip: str = D.CROSS_CLIP,
                      cross_clip_delta: float = D.CROSS_CLIP_DELTA,
                      cross_clip_step: float = D.CROSS_CLIP_STEP,
                      self_clip_low: float = D.SELF_CLIP_LOW,
                      self_clip_high: float = D.SELF_CLIP_HIGH,
                      max_abs_log_ratio: float = D.MAX_ABS_LOG_RATIO, divisor=None):
    """HACPO minibatch loss: GSPO on self samples + the capability-weighted cross objective.

    new_lp, old_lp: [N] per-sequence mean token log-probs (learner now / generator at sampling);
    advantages: [N] (hacpo_advantages); is_self: [N] bool; omega: [N] = omega[source_i, learner]
    (1 for self samples; pass ones to switch the capability coefficient off);
    minibatch_index: m, 0-based count of updates within the step.

    self:  obj = min(s*A, clip(s, 1-self_clip_low, 1+self_clip_high)*A)
    cross: c = clamp(s, lo_m, 1); obj = c * sg(c)^alpha * omega * A   (no pessimistic min)
    loss = -sum(obj) / divisor (default N). Returns (loss [], metrics).
    """
    n = check_same_length(new_lp=new_lp, old_lp=old_lp, advantages=advantages, is_self=is_self,
                          omega=omega)
    if not 0 <= alpha < float("inf"):        # NaN fails it too
        raise ValueError(f"alpha must be finite and >= 0, got {alpha}")
    if isinstance(minibatch_index, bool) or not isinstance(minibatch_index, numbers.Integral) \
            or minibatch_index < 0:
        raise ValueError(f"minibatch_index must be a whole number >= 0 (the update's 0-based "
                         f"index in the step), got {minibatch_index!r}")
    minibatch_index = int(minibatch_index)      # e.g. a numpy integer
    _check_clip(self_clip_low=self_clip_low, self_clip_high=self_clip_high,
                cross_clip_delta=cross_clip_delta, cross_clip_step=cross_clip_step,
                max_abs_log_ratio=max_abs_log_ratio)
    is_self = is_self.bool()
    lo = cross_lower_bound(cross_clip, minibatch_index, cross_clip_delta, cross_clip_step)
    if omega.device.type == "cpu":      # (a device tensor's values: a host sync, not checked)
        bad = ~(torch.isfinite(omega) & (omega > 0))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"omega[{i}] is {float(omega[i])}: capability ratios must be "
                             f"finite and > 0 ({int(bad.sum())} bad of {omega.numel()})")
    s = sequence_ratio(new_lp, old_lp, max_abs_log_ratio)
    obj_self = gspo_objective(s, advantages, self_clip_low, self_clip_high)
    c = s.clamp(min=lo, max=1.0) if cross_clip != "none" else s
    obj_cross = c * c.detach().pow(alpha) * omega.to(s.dtype) * advantages
    obj = torch.where(is_self, obj_self, obj_cross)
    loss = -_divide(obj.sum(), divisor, n)
    with torch.no_grad():
        sd = s.detach()
        cross = ~is_self
        self_clipped = (sd < 1 - self_clip_low) | (sd > 1 + self_clip_high)
        below = (sd < lo) if cross_clip != "none" else torch.zeros_like(cross)
        above = (sd > 1) if cross_clip != "none" else torch.zeros_like(cross)
        metrics = {
            "self_ratio_mean": _masked_mean(sd, is_self),
            "cross_ratio_mean": _masked_mean(sd, cross),
            "self_clip_frac": _masked_mean(self_clipped.to(sd.dtype), is_self),
            "cross_clip_low_frac": _masked_mean(below.to(sd.dtype), cross),
            "cross_clip_high_frac": _masked_mean(above.to(sd.dtype), cross),
            "self_count": is_self.sum(),
            "cross_count": cross.sum(),
            "cross_lower_bound": torch.tensor(lo, dtype=sd.dtype, device=sd.device),
        }
    return loss, metrics


def grpo_policy_loss(token_logp: torch.Tensor, old_token_logp: torch.Tensor, mask: torch.Tensor,
                     advantages: torch.Tensor, *, clip_low: float = D.GRPO_CLIP_LOW,
                     clip_high: float = D.GRPO_CLIP_HIGH,
                     max_abs_log_ratio: float = D.GRPO_MAX_ABS_LOG_RATIO, divisor=None):
    """GRPO: token-level ratio, clip [1-clip_low, 1+clip_high], token-mean over the mask.

    token_logp, old_token_logp, mask: [B, T]; advantages: [B] (broadcast over tokens).
    ratio = exp(clamp(token_logp - old_token_logp, -max, max)): without the clamp a log-ratio
    past ~88 overflows float32 and one token makes the loss NaN (inf * A with A = 0) or its
    gradient NaN (0 * inf in the clipped branch); outside the clamp a token has no gradient.
    loss = -sum_{masked} obj / divisor (default: masked tokens here). Returns (loss [], metrics).
    """
    check_same_shape(token_logp=token_logp, old_token_logp=old_token_logp, mask=mask)
    if token_logp.dim() != 2 or advantages.shape != token_logp.shape[:1]:
        raise ValueError(f"expected token_logp [B, T] and advantages [B], got "
                         f"{tuple(token_logp.shape)} and {tuple(advantages.shape)}")
    _check_clip(clip_low=clip_low, clip_high=clip_high, max_abs_log_ratio=max_abs_log_ratio)
    m = mask.to(token_logp.dtype)
    # padding (-inf or NaN log-probs) is not read: 0 * NaN would reach the loss and, through
    # exp's backward, the gradient
    token_logp, old_token_logp = (torch.where(m.bool(), x, 0) for x in (token_logp,
                                                                         old_token_logp))
    ratio = sequence_ratio(token_logp, old_token_logp, max_abs_log_ratio)   # per token here
    a = advantages[:, None].to(token_logp.dtype)
    obj = torch.minimum(ratio * a, ratio.clamp(1 - clip_low, 1 + clip_high) * a)
    acc = torch.promote_types(token_logp.dtype, torch.float32)   # half sums overflow / round
    count = m.sum(dtype=acc)
    # no masked token: an error on the CPU as for GSPO / HACPO (a device count is not read:
    # a host sync; 0 there)
    loss = -_divide((obj * m).sum(dtype=acc), divisor,
                    count if count.device.type == "cpu" else count.clamp_min(1)).to(obj.dtype)
    with torch.no_grad():
        rd = ratio.detach()
        clipped = ((rd < 1 - clip_low) | (rd > 1 + clip_high)).to(rd.dtype)
        metrics = {"token_ratio_mean": (rd * m).sum() / count.clamp_min(1),
                   "token_clip_frac": (clipped * m).sum() / count.clamp_min(1)}
    return loss, metrics


def kl_numerator(kl: torch.Tensor, mask: torch.Tensor, token_level: bool) -> torch.Tensor:
    """The KL penalty of a batch of self rows before the minibatch's divisor, aggregated as the
    policy loss is: ``kl`` [B] per-sequence means (:func:`low_var_kl`), ``mask`` [B, T]. A
    token-level loss (grpo: token-mean, divisor = the minibatch's tokens) sums the estimator
    over tokens; a sequence-level one (gspo, hacpo: divisor = its sequences) sums the
    per-sequence means. -> scalar."""
    if token_level:
        return (kl * mask.to(kl.dtype).sum(-1)).sum()
    return kl.sum()


def low_var_kl(token_logp: torch.Tensor, ref_token_logp: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean of the low-variance KL estimator k3 = exp(d) - d - 1, d = ref-lp clamped
    to [-20, 20], k3 to [-10, 10] per token, as the reference implementation. [B, T] -> [B]."""
    check_same_shape(token_logp=token_logp, ref_token_logp=ref_token_logp, mask=mask)
    keep = mask.bool()          # padding (-inf, NaN) is not read, in the value or the gradient
    d = (torch.where(keep, ref_token_logp, 0) - torch.where(keep, token_logp, 0)).clamp(-20, 20)
    k3 = (torch.exp(d) - d - 1).clamp(-10, 10)
    m = mask.to(k3.dtype)
    return (k3 * m).sum(-1) / m.sum(-1).clamp_min(1)
