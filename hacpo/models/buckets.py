"""Weights moved in buckets: a weight sync or pull never holds a second copy of a model.

    plan = plan_buckets([(unit, nbytes), ...], bucket_bytes)   # [[unit, ...], ...] in order
    buckets = weight_buckets(state_dict, bucket_bytes)          # [{name: tensor}, ...]
    n = copy_buckets(model.state_dict(), buckets, what="...")   # in place, every name once

Pure tensor bookkeeping (no communication): the megatron weight pull
(``hacpo/launch/megatron_trainer.py``), the vLLM and the Ray rollout pools' weight syncs use
these.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import TypeVar

import torch

K = TypeVar("K")


def plan_buckets(unit_bytes: Sequence[tuple[K, int]], bucket_bytes: int) -> list[list[K]]:
    """Consecutive units (any keys: model units, tensor names) grouped into buckets of at most
    ``bucket_bytes`` (a unit larger than that is a bucket of its own), in order."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    out: list[list[K]] = []
    size = 0
    for unit, n in unit_bytes:
        if out and size + n <= bucket_bytes:
            out[-1].append(unit)
            size += n
        else:
            out.append([unit])
            size = n
    return out


def weight_buckets(weights: Mapping[str, torch.Tensor],
                   bucket_bytes: int) -> list[dict[str, torch.Tensor]]:
    """``weights`` (named, in order) grouped into dicts of at most ``bucket_bytes`` (a larger
    tensor alone): what one object of a bucketed weight sync holds."""
    plan = plan_buckets([(n, t.numel() * t.element_size()) for n, t in weights.items()],
                        bucket_bytes)
    return [{n: weights[n] for n in names} for names in plan]


def bucket_bytes_of(mb: float) -> int:
    """A bucket size in MiB (a config's ``*.weight_bucket_mb``) -> bytes (at least 1)."""
    return max(1, int(mb * 2 ** 20))


@torch.no_grad()
def copy_buckets(target: MutableMapping[str, torch.Tensor],
                 buckets: Iterable[Mapping[str, torch.Tensor]], *, what: str) -> int:
    """Copy every bucket's tensors into ``target``'s tensors of the same name, in place (e.g.
    ``model.state_dict()``, whose tensors share the parameters' storage), as the buckets
    arrive (so at most one bucket is held besides the model). Every name of ``target`` must
    come exactly once, with its shape; otherwise a RuntimeError starting with ``what`` names
    the tensor (a failure part-way leaves the target partly updated: the caller treats its
    weights as unknown). Returns the number of buckets."""
    seen: set[str] = set()
    n = 0
    for bucket in buckets:
        n += 1
        for name, t in bucket.items():
            _check_fits(name, tuple(t.shape), target, seen, what)
            target[name].copy_(t)
            seen.add(name)
    _check_complete(target, seen, what)
    return n


def check_bucket_shapes(target: Mapping[str, torch.Tensor],
                        buckets: Iterable[Mapping[str, tuple[int, ...]]], *, what: str) -> None:
    """:func:`copy_buckets`' checks on the buckets' names and shapes alone (``buckets``: name
    -> shape), for weights that go elsewhere than ``target`` (e.g. straight to the rollout
    engines): every name of ``target`` exactly once, with its shape, else a RuntimeError
    starting with ``what``."""
    seen: set[str] = set()
    for bucket in buckets:
        for name, shape in bucket.items():
            _check_fits(name, tuple(shape), target, seen, what)
            seen.add(name)
    _check_complete(target, seen, what)


def _check_fits(name: str, shape: tuple, target: Mapping[str, torch.Tensor], seen: set,
                what: str) -> None:
    why = ("there is no such weight" if name not in target else
           "sent twice" if name in seen else
           f"the target's is {tuple(target[name].shape)}"
           if tuple(target[name].shape) != shape else None)
    if why:
        raise RuntimeError(f"{what}: weight {name!r} {shape} does not fit: {why}")


def _check_complete(target: Mapping, seen: set, what: str) -> None:
    if seen != target.keys():
        raise RuntimeError(f"{what}: weights missing: {sorted(target.keys() - seen)}")
