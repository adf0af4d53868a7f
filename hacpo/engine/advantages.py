"""Group-relative advantages (SPEC "Advantages for learner k"), vectorized with segment ops.

Samples carry a ``prompt`` id (their group) and, for HACPO, an ``agent`` id (their source).
No Python loop runs over samples or groups: per-group sums are ``index_add_`` / ``scatter_reduce``
and the capability-weighted baselines of every (group, agent) pair are one [P, n] x [n, n] matmul.
"""
from __future__ import annotations

import numbers

import torch

from . import defaults as D
from .validation import check_agents, check_rewards, check_same_length


def _groups(prompt: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Compact group index [N] in 0..P-1 for arbitrary prompt ids, and P."""
    if prompt.dtype.is_floating_point:
        raise TypeError(f"prompt ids must be an integer tensor, got {prompt.dtype}")
    if prompt.numel() == 0:
        return prompt.long(), 0
    lo, hi = torch.aminmax(prompt)
    lo, span = int(lo), int(hi) - int(lo) + 1
    if span > 4 * prompt.numel() + 1024:            # sparse ids: sort-based unique
        uniq, inv = torch.unique(prompt, return_inverse=True)
        return inv, uniq.numel()
    # dense ids: O(N) compaction without a sort (the sort dominated at N = 1e6)
    shifted = prompt.long() - lo       # in int64: an int8/int16 difference can wrap
    present = torch.zeros(span, dtype=torch.bool, device=prompt.device)
    present[shifted] = True
    remap = torch.cumsum(present, 0) - 1
    return remap[shifted], int(remap[-1]) + 1


def _group_stats(r: torch.Tensor, g: torch.Tensor, num_groups: int, eps: float):
    """r [N], g [N] in 0..P-1 -> per-group count [P], mean [P], sigma [P] (unbiased std + eps;
    0 + eps for size-1 groups), and whether the group's rewards are all equal [P] bool."""
    if not 0 < eps < float("inf"):
        raise ValueError(f"eps must be finite and > 0 (a uniform or one-sample group's sigma "
                         f"is eps), got {eps}")
    cnt = torch.bincount(g, minlength=num_groups).to(r.dtype)
    mean = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, g, r) / cnt
    hi = torch.full_like(mean, -torch.inf).scatter_reduce_(0, g, r, "amax")
    lo = torch.full_like(mean, torch.inf).scatter_reduce_(0, g, r, "amin")
    uniform = hi == lo
    # a uniform group's mean is its value exactly: sum / count rounds (e.g. 8 x 0.1 in float32
    # gives 0.1 + 7e-9, i.e. |A| ~ 7e-3 after dividing by sigma = eps), and SPEC requires
    # uniform-reward groups to give zero advantages
    mean = torch.where(uniform, hi, mean)
    dev2 = (r - mean[g]).square()
    ss = torch.zeros_like(mean).index_add_(0, g, dev2)
    var = torch.where(cnt > 1, ss / (cnt - 1).clamp_min(1), torch.zeros_like(ss))
    sigma = var.sqrt() + eps
    return cnt, mean, sigma, uniform


def _check_ratios(ratios: torch.Tensor) -> None:
    """Capability ratios must be finite and > 0 (the baseline weights are 1 / omega)."""
    bad = ~(torch.isfinite(ratios) & (ratios > 0))
    if bool(bad.any()):
        s, t = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"ratios[{s}, {t}] is {float(ratios[s, t])}: capability ratios must be "
                         f"finite and > 0 ({int(bad.sum())} bad of {ratios.numel()})")


def group_advantages(rewards: torch.Tensor, prompt: torch.Tensor, *, eps: float = D.ADV_EPS,
                     validate: bool = True) -> torch.Tensor:
    """Plain group-normalized advantages (GRPO, GSPO, naive).

    rewards: [N] float in [0, 1]; prompt: [N] integer group ids.
    Returns A [N] = (r - mean_group) / (std_group + eps), std unbiased (0 for single samples).
    """
    check_same_length(rewards=rewards, prompt=prompt)
    if validate:
        check_rewards(rewards, prompt=prompt)
    g, num_groups = _groups(prompt)
    _, mean, sigma, _ = _group_stats(rewards, g, num_groups, eps)
    return (rewards - mean[g]) / sigma[g]


def hacpo_advantages(rewards: torch.Tensor, prompt: torch.Tensor, agent: torch.Tensor, *,
                     learner: int, ratios: torch.Tensor, eps: float = D.ADV_EPS,
                     uniform_guard: bool = True, binary_guard: bool = True,
                     cross_baseline: str = "learner", validate: bool = True) -> torch.Tensor:
    """Capability-aware advantages for ``learner`` over the whole pool (self and cross samples).

    rewards: [N] float in [0, 1]; prompt: [N] group ids; agent: [N] source agent in 0..n-1;
    ratios: [n, n] with ratios[s, t] = omega[s, t] (CapabilityTracker.ratios()).

    For group g and agent a the capability baseline is
        mu[g, a] = mean_{i in g} r_i / omega[s_i, a]          (= (S @ (1/omega))[g, a] / |g|,
                                                                S[g, s] = sum of s's rewards in g)
    uniform guard: all rewards in g equal -> mu = mean r.  binary guard: mu > 1 -> mean reward of
    agent a's own samples in g (plain group mean if a has none there [ours]).
    A_i = (r_i - mu[g_i, learner]) / (std_g + eps); with cross_baseline="source" a cross sample
    uses its source's baseline mu[g_i, s_i] instead (the paper's Eq. 10 reading).
    Returns A [N] in the dtype/device of ``rewards``.
    """
    check_same_length(rewards=rewards, prompt=prompt, agent=agent)
    if ratios.dim() != 2 or ratios.shape[0] != ratios.shape[1]:
        raise ValueError(f"ratios must be [n, n], got shape {tuple(ratios.shape)}")
    n = ratios.shape[0]
    if isinstance(learner, bool) or not isinstance(learner, numbers.Integral) \
            or not 0 <= learner < n:        # 0.5 acted as learner 0
        raise ValueError(f"learner must be an agent index in 0..{n - 1}, got {learner!r}")
    if cross_baseline not in D.CROSS_BASELINES:
        raise ValueError(f"unknown cross_baseline {cross_baseline!r}; choose one of "
                         f"{D.CROSS_BASELINES}")
    if validate:
        check_rewards(rewards, agent=agent, prompt=prompt)
        check_agents(agent, n)
        _check_ratios(ratios)
    agent = agent.long()
    r = rewards
    g, num_groups = _groups(prompt)
    cnt, mean, sigma, uniform = _group_stats(r, g, num_groups, eps)

    cell = g * n + agent                                              # (group, source) cell [N]
    S = torch.zeros(num_groups * n, dtype=r.dtype, device=r.device).index_add_(0, cell, r)
    C = torch.bincount(cell, minlength=num_groups * n).to(r.dtype)
    S, C = S.view(num_groups, n), C.view(num_groups, n)
    inv_omega = ratios.to(device=r.device, dtype=r.dtype).reciprocal()   # w for (source, learner)
    mu = (S @ inv_omega) / cnt[:, None]                               # [P, n]
    if uniform_guard:
        mu = torch.where(uniform[:, None], mean[:, None].expand_as(mu), mu)
    if binary_guard:
        own = torch.where(C > 0, S / C.clamp_min(1), mean[:, None].expand_as(S))
        mu = torch.where(mu > 1, own, mu)
    column = agent if cross_baseline == "source" else torch.full_like(agent, learner)
    return (r - mu[g, column]) / sigma[g]
