"""Algorithm configuration: typed dataclasses (each default defined once, in ``defaults``),
named presets, validated overrides.

    cfg = preset("hacpo")                         # SPEC defaults = the authors' reference config
    cfg = preset("hacpo-table5")                  # delta = 0.8 (lower bound 0.2)
    cfg = cfg.override({"loss.alpha": 0})         # CLI/YAML only override, never redefine
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from . import defaults as D
from .configtools import ConfigMixin

ALGORITHMS = ("grpo", "gspo", "gspo2x", "naive", "hacpo")
MINIBATCH_ORDERS = ("mixed", "self_first")


MAX_LOG_FLOAT32 = math.log(D.FLOAT32_MAX)    # ~88.72: exp of a larger log-ratio is inf


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True)
class CapabilityConfig:
    window: int = D.CAPABILITY_WINDOW
    metric: str = D.CAPABILITY_METRIC
    minimum: float = D.CAPABILITY_MINIMUM
    ratio_min: float = D.RATIO_MIN
    ratio_max: float = D.RATIO_MAX

    def __post_init__(self):
        _require(isinstance(self.window, int) and self.window >= 1,
                 f"capability.window must be an integer >= 1, got {self.window!r}")
        _require(self.metric in D.CAPABILITY_METRICS,
                 f"capability.metric {self.metric!r} unknown; choose one of {D.CAPABILITY_METRICS}")
        # a floor of 1 or more is every agent's capability: every ratio 1, the weighting off
        _require(0 < self.minimum < 1, f"capability.minimum must be in (0, 1) (a floor under "
                                       f"success rates), got {self.minimum}")
        # the coefficient omega is float32 in the loss: bounds past its range are 0 or inf
        _require(D.FLOAT32_TINY <= self.ratio_min < math.inf,
                 f"capability.ratio_min must be finite and >= {D.FLOAT32_TINY:.4g} "
                 f"(float32's smallest normal number: omega is float32), got {self.ratio_min}")
        _require(self.ratio_max <= D.FLOAT32_MAX,
                 f"capability.ratio_max must be <= {D.FLOAT32_MAX:.4g} (float32's largest: "
                 f"omega is float32), got {self.ratio_max}")
        _require(self.ratio_min <= self.ratio_max,
                 f"capability.ratio_min ({self.ratio_min}) must be <= ratio_max "
                 f"({self.ratio_max})")
        # an agent's ratio to itself is 1: a clamp range without 1 reweights its own samples
        _require(self.ratio_min <= 1 <= self.ratio_max,
                 f"capability.ratio_min ({self.ratio_min}) must be <= 1 <= ratio_max "
                 f"({self.ratio_max}): an agent's capability ratio to itself is 1")


@dataclass(frozen=True)
class AdvantageConfig:
    eps: float = D.ADV_EPS
    uniform_guard: bool = True
    binary_guard: bool = True
    cross_baseline: str = "learner"
    capability_baseline: bool = True  # off: every w_i = 1 (plain mean baseline over the pool)

    def __post_init__(self):
        # past float32's largest it is infinite in the (float32) rewards' arithmetic
        _require(0 < self.eps <= D.FLOAT32_MAX,
                 f"advantage.eps must be finite and > 0 (a uniform or one-sample group's sigma "
                 f"is eps; an infinite one makes every advantage 0), got {self.eps}")
        _require(self.cross_baseline in D.CROSS_BASELINES,
                 f"advantage.cross_baseline {self.cross_baseline!r} unknown; choose one of "
                 f"{D.CROSS_BASELINES}")


@dataclass(frozen=True)
class LossConfig:
    self_clip_low: float = D.SELF_CLIP_LOW
    self_clip_high: float = D.SELF_CLIP_HIGH
    max_abs_log_ratio: float = D.MAX_ABS_LOG_RATIO
    alpha: float = D.ALPHA
    capability_coefficient: bool = True  # off: omega = 1 in the cross objective
    cross_clip: str = D.CROSS_CLIP
    cross_clip_delta: float = D.CROSS_CLIP_DELTA
    cross_clip_step: float = D.CROSS_CLIP_STEP
    grpo_clip_low: float = D.GRPO_CLIP_LOW
    grpo_clip_high: float = D.GRPO_CLIP_HIGH
    kl_coef: float = D.KL_COEF

    def __post_init__(self):
        _require(0 <= self.alpha < math.inf,
                 f"loss.alpha must be finite and >= 0, got {self.alpha}")
        _require(0 <= self.cross_clip_delta <= 1,
                 f"loss.cross_clip_delta must be in [0, 1], got {self.cross_clip_delta}")
        _require(0 <= self.cross_clip_step < math.inf,
                 f"loss.cross_clip_step must be finite and >= 0, got {self.cross_clip_step}")
        _require(self.cross_clip in D.CROSS_CLIPS,
                 f"loss.cross_clip {self.cross_clip!r} unknown; choose one of {D.CROSS_CLIPS}")
        for name in ("self_clip_low", "self_clip_high", "grpo_clip_low", "grpo_clip_high"):
            v = getattr(self, name)
            _require(0 <= v, f"loss.{name} must be >= 0, got {v}")
        for name in ("self_clip_low", "grpo_clip_low"):     # the ratio's lower bound 1 - v
            v = getattr(self, name)
            _require(v < 1, f"loss.{name} must be in [0, 1) (the ratio's lower clip bound is "
                            f"1 - {name}), got {v}")
        # the log-ratio is exponentiated in float32: a bound whose exp overflows bounds nothing
        # (an infinite ratio, a NaN loss), and one past float32's range fails the clamp
        _require(0 < self.max_abs_log_ratio <= MAX_LOG_FLOAT32,
                 f"loss.max_abs_log_ratio must be finite and > 0 (it bounds the log-ratio that "
                 f"is exponentiated) and <= {MAX_LOG_FLOAT32:.4g} (exp of more overflows "
                 f"float32), got {self.max_abs_log_ratio}")
        _require(0 <= self.kl_coef < math.inf,
                 f"loss.kl_coef must be finite and >= 0, got {self.kl_coef}")


@dataclass(frozen=True)
class AlgorithmConfig(ConfigMixin):
    """Which algorithm (SPEC's table of baselines) and its switches."""
    name: str = "hacpo"
    capability: CapabilityConfig = field(default_factory=CapabilityConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    num_minibatches: int = 4        # M updates per step; m = 0..M-1 indexes the stepwise clip
    minibatch_order: str = "mixed"  # mixed (by prompt, shuffled) | self_first (ref behaviour)

    def __post_init__(self):
        _require(self.name in ALGORITHMS,
                 f"unknown algorithm {self.name!r}; choose one of {ALGORITHMS}")
        _require(isinstance(self.num_minibatches, int) and self.num_minibatches >= 1,
                 f"num_minibatches must be an integer >= 1, got {self.num_minibatches!r}")
        _require(self.minibatch_order in MINIBATCH_ORDERS,
                 f"minibatch_order {self.minibatch_order!r} unknown; choose one of "
                 f"{MINIBATCH_ORDERS}")

    # What the trainer derives from the name (SPEC's table), in one place.
    @property
    def shares_samples(self) -> bool:
        """Does a learner train on other agents' responses?"""
        return self.name in ("naive", "hacpo")

    @property
    def samples_per_prompt_factor(self) -> int:
        """gspo2x samples 2G responses per prompt (HACPO's rollout cost for two agents)."""
        return 2 if self.name == "gspo2x" else 1

    @property
    def minibatch_factor(self) -> int:
        """gspo2x uses half-size minibatches, i.e. twice as many updates per step."""
        return 2 if self.name == "gspo2x" else 1

    @property
    def token_level(self) -> bool:
        return self.name == "grpo"

    def unused_settings(self) -> list[str]:
        """``KEY=VALUE`` of the settings this algorithm never reads that differ from their
        default (e.g. ``loss.alpha`` under gspo, the GSPO clip under grpo, the stepwise clip's
        step under hacpo with ``loss.cross_clip=static``); ``capability.*``
        is read by every algorithm (the tracker's metrics), hacpo's ratios by hacpo only."""
        default = AlgorithmConfig()
        if self.name == "hacpo":
            keys = GRPO_ONLY
        elif self.name == "grpo":
            keys = HACPO_ONLY + SEQUENCE_ONLY
        else:
            keys = HACPO_ONLY + GRPO_ONLY
        if self.name == "hacpo" and self.loss.cross_clip != "stepwise":
            keys = keys + (("loss.cross_clip_step",) if self.loss.cross_clip == "static"
                           else ("loss.cross_clip_delta", "loss.cross_clip_step"))
        out = []
        for key in keys:
            section, name = key.split(".")
            v = getattr(getattr(self, section), name)
            if v != getattr(getattr(default, section), name):
                out.append(f"algorithm.{key}={v!r}")
        return out


# what each algorithm never reads (algorithm.py): hacpo's advantage and cross-objective
# switches outside hacpo, GSPO's sequence clip under grpo (its own token clip, +-20 bound),
# grpo's clip outside grpo
HACPO_ONLY = ("advantage.uniform_guard", "advantage.binary_guard", "advantage.cross_baseline",
              "advantage.capability_baseline", "loss.alpha", "loss.capability_coefficient",
              "loss.cross_clip", "loss.cross_clip_delta", "loss.cross_clip_step")
SEQUENCE_ONLY = ("loss.self_clip_low", "loss.self_clip_high", "loss.max_abs_log_ratio")
GRPO_ONLY = ("loss.grpo_clip_low", "loss.grpo_clip_high")


_PRESETS: dict[str, dict[str, Any]] = {
    "hacpo": {},
    "hacpo-table5": {"loss.cross_clip_delta": 0.8},
    "grpo": {"name": "grpo"},
    "gspo": {"name": "gspo"},
    "gspo2x": {"name": "gspo2x"},
    "naive": {"name": "naive"},
    # Ablations: each switches one HACPO mechanism off (SPEC's table).
    "hacpo-no-capability-baseline": {"advantage.capability_baseline": False},
    "hacpo-no-capability-coefficient": {"loss.capability_coefficient": False},
    "hacpo-alpha0": {"loss.alpha": 0.0},
    "hacpo-static-clip": {"loss.cross_clip": "static"},
    "hacpo-no-cross-clip": {"loss.cross_clip": "none"},
    "hacpo-source-baseline": {"advantage.cross_baseline": "source"},
    "hacpo-self-first": {"minibatch_order": "self_first"},
}


def available_presets() -> tuple[str, ...]:
    return tuple(_PRESETS)


def preset_settings(name: str) -> dict[str, Any]:
    """The dotted keys preset ``name`` sets over the defaults (what makes it that preset)."""
    preset(name)                                    # an unknown name: the same error
    return dict(_PRESETS[name])


def preset(name: str, overrides: dict[str, Any] | None = None) -> AlgorithmConfig:
    """Named preset, then optional dotted-key overrides (see AlgorithmConfig.override)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown algorithm preset {name!r}; choose one of {available_presets()}")
    return AlgorithmConfig().override({**_PRESETS[name], **(overrides or {})})
