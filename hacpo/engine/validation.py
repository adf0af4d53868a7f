"""Input checks shared by the algorithm functions.

Shape checks are free (no device sync). Value checks (rewards in [0, 1], agent ids in range,
empty sequences) need one host sync each and name the first offending sample in the error.
"""
from __future__ import annotations

import torch


def check_tensors(**values) -> None:
    """Each value must be a torch.Tensor: a list or a numpy array is a TypeError naming the
    argument (not an AttributeError about ``.dim`` or ``.bool``)."""
    for name, v in values.items():
        if not torch.is_tensor(v):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(v).__name__} (wrap it "
                            f"with torch.as_tensor)")


def check_same_length(**tensors: torch.Tensor) -> int:
    """All tensors must be 1-D with the same length; returns it."""
    check_tensors(**tensors)
    n = None
    for name, t in tensors.items():
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D [N], got shape {tuple(t.shape)}")
        if n is None:
            n = t.shape[0]
        elif t.shape[0] != n:
            shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in tensors.items())
            raise ValueError(f"shape mismatch: expected every input to be [N]; got {shapes}")
    return int(n or 0)


def check_same_shape(**tensors: torch.Tensor) -> None:
    check_tensors(**tensors)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError("shape mismatch: " + ", ".join(f"{k}={s}" for k, s in shapes.items()))


def check_rewards(rewards: torch.Tensor, agent: torch.Tensor | None = None,
                  prompt: torch.Tensor | None = None) -> None:
    """Rewards must be finite and in [0, 1]; the error names the sample (and its prompt/agent)."""
    if not torch.is_floating_point(rewards):
        raise TypeError(f"rewards must be a floating tensor, got {rewards.dtype}")
    bad = ~((rewards >= 0) & (rewards <= 1))  # NaN compares False -> bad
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        where = f"sample {i}"
        if prompt is not None:
            where += f" (prompt {int(prompt[i])}"
            where += f", agent {int(agent[i])})" if agent is not None else ")"
        elif agent is not None:
            where += f" (agent {int(agent[i])})"
        raise ValueError(f"reward of {where} is {float(rewards[i])}: rewards must be finite and "
                         f"in [0, 1] ({int(bad.sum())} bad of {rewards.numel()})")


def check_agents(agent: torch.Tensor, num_agents: int) -> None:
    if agent.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"agent must be an integer tensor, got {agent.dtype}")
    bad = (agent < 0) | (agent >= num_agents)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"agent index {int(agent[i])} of sample {i} is out of range "
                         f"0..{num_agents - 1}")
