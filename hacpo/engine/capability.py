"""Sliding-window capability estimate per agent and the capability ratios (SPEC "Capability")."""
from __future__ import annotations

import numbers

import torch

from . import defaults as D
from .validation import check_agents, check_rewards, check_same_length


class CapabilityTracker:
    """Phat(a): mean of the last ``window`` per-step capabilities P_t(a), including this step.

    P_t(a) = fraction of agent a's rewards that are > 0 (``positive_rate``) or their mean
    (``reward_mean``), floored at ``minimum``. Before the first update every Phat is 1.
    ``ratios()[s, t] = omega[s, t] = clamp(Phat_s / Phat_t, ratio_min, ratio_max)``.

    State lives on the device of the first rewards seen; nothing here calls ``.item()``
    except input validation.
    """

    def __init__(self, num_agents: int, window: int = D.CAPABILITY_WINDOW,
                 metric: str = D.CAPABILITY_METRIC, minimum: float = D.CAPABILITY_MINIMUM,
                 ratio_min: float = D.RATIO_MIN, ratio_max: float = D.RATIO_MAX,
                 validate: bool = True):
        for name, v in (("num_agents", num_agents), ("capability window", window)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
        num_agents, window = int(num_agents), int(window)     # e.g. a numpy integer
        if metric not in D.CAPABILITY_METRICS:
            raise ValueError(f"unknown capability metric {metric!r}; choose one of "
                             f"{D.CAPABILITY_METRICS}")
        if not (0 < minimum < 1):      # >= 1 floors every agent's capability: every ratio 1
            raise ValueError(f"capability minimum must be in (0, 1), got {minimum}")
        # 1 inside: an agent's ratio to itself is 1 (its own samples keep weight 1)
        if not (0 < ratio_min <= 1 <= ratio_max):
            raise ValueError(f"need 0 < ratio_min <= 1 <= ratio_max, got {ratio_min}, "
                             f"{ratio_max}")
        self.num_agents, self.window, self.metric = num_agents, window, metric
        self.minimum, self.ratio_min, self.ratio_max = minimum, ratio_min, ratio_max
        self.validate = validate
        # history[:, j] holds step (count - 1 - j)'s value once filled; a ring would save a copy
        # of n*K floats per step, not worth the index arithmetic.
        self.history = torch.ones(num_agents, window, dtype=torch.float64)
        self.count = 0

    def step_capability(self, rewards: torch.Tensor, agent: torch.Tensor) -> torch.Tensor:
        """P_t [n] for one step's rewards [N] from agents [N] (every agent must be present)."""
        n = self.num_agents
        hits = (rewards > 0).to(torch.float64) if self.metric == "positive_rate" \
            else rewards.to(torch.float64)
        total = torch.zeros(n, dtype=torch.float64, device=rewards.device).index_add_(0, agent, hits)
        cnt = torch.bincount(agent, minlength=n).to(torch.float64)
        if self.validate and bool((cnt == 0).any()):
            missing = (cnt == 0).nonzero().flatten().tolist()
            raise ValueError(f"capability update has no samples for agent(s) {missing}: every "
                             f"agent must contribute rewards each step")
        return (total / cnt.clamp_min(1)).clamp_min(self.minimum)

    def update(self, rewards: torch.Tensor, agent: torch.Tensor) -> torch.Tensor:
        """Record one step. rewards: [N] float in [0, 1]; agent: [N] long. Returns Phat [n]."""
        check_same_length(rewards=rewards, agent=agent)
        if self.validate:
            check_rewards(rewards, agent=agent)
            check_agents(agent, self.num_agents)
        p = self.step_capability(rewards, agent.long())
        hist = self.history.to(p.device)
        self.history = torch.cat([p[:, None], hist[:, :-1]], dim=1)
        self.count += 1
        return self.phat()

    def phat(self) -> torch.Tensor:
        """Phat [n] float64: mean over the last min(count, window) steps; ones before any."""
        if self.count == 0:
            return torch.ones(self.num_agents, dtype=torch.float64, device=self.history.device)
        k = min(self.count, self.window)
        return self.history[:, :k].mean(dim=1)

    def ratios(self) -> torch.Tensor:
        """omega [n, n] float64: omega[s, t] = clamp(Phat_s / Phat_t, ratio_min, ratio_max)."""
        p = self.phat()
        return (p[:, None] / p[None, :]).clamp(self.ratio_min, self.ratio_max)

    def state_dict(self) -> dict:
        """num_agents, window, metric, history [n, window] float64 (newest first), count."""
        return {"num_agents": self.num_agents, "window": self.window, "metric": self.metric,
                "history": self.history.detach().cpu().clone(), "count": self.count}

    def load_state_dict(self, sd: dict) -> None:
        """Restore `state_dict()`; ValueError if its num_agents / window / metric differ, or its
        history is no [num_agents, window] table of finite values > 0, or its count no whole
        number >= 0."""
        for key in ("num_agents", "window", "metric"):
            if sd[key] != getattr(self, key):
                raise ValueError(f"capability tracker state has {key}={sd[key]!r} but this tracker "
                                 f"has {key}={getattr(self, key)!r}")
        want = (self.num_agents, self.window)
        hist = sd["history"]
        try:
            hist = torch.as_tensor(hist, dtype=torch.float64)   # a list (a state read from JSON)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"capability tracker state's history is no [{want[0]}, {want[1]}] "
                             f"table of numbers: {e}") from None
        if tuple(hist.shape) != want:
            raise ValueError(f"capability tracker state's history has shape {tuple(hist.shape)}"
                             f", not [num_agents, window] = [{want[0]}, {want[1]}]")
        if not bool((torch.isfinite(hist) & (hist > 0)).all()):
            raise ValueError("capability tracker state's history holds values that are not "
                             "finite and > 0 (capabilities are floored above 0)")
        count = sd["count"]
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise ValueError(f"capability tracker state's count must be a whole number >= 0, "
                             f"got {count!r}")
        self.history = hist.clone().to(self.history.device)
        self.count = int(count)
