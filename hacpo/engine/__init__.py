"""HACPO algorithm library: pure-tensor math (SPEC's public API) plus the algorithm config.

Importing this package imports torch only (no ray, vllm, megatron or transformers); the
trainer, rollout and I/O modules live beside it and are imported explicitly.
"""
from .advantages import group_advantages, hacpo_advantages
from .capability import CapabilityTracker
from .config import AlgorithmConfig, available_presets, preset
from .losses import (grpo_policy_loss, gspo_policy_loss, hacpo_policy_loss, low_var_kl,
                     sequence_mean_logprob)

__all__ = [
    "CapabilityTracker", "hacpo_advantages", "group_advantages", "sequence_mean_logprob",
    "hacpo_policy_loss", "gspo_policy_loss", "grpo_policy_loss", "low_var_kl",
    "AlgorithmConfig", "preset", "available_presets",
]
