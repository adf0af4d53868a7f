"""Shared plumbing for the log-prob kernels: backend choice, validation, vocab-parallel layout.

Nothing here imports triton. The Triton kernels live in `_logprobs_triton.py`, imported only
when the triton backend is actually used, so `TRITON_INTERPRET=1` can still be set by a caller
(e.g. a test conftest) after `import hacpo.kernels`.
"""
from __future__ import annotations

import importlib.util
import math
import os

import torch
import torch.distributed as dist

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """TRITON_INTERPRET is on, read as triton reads it (1/true/on/yes/y, any case)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y")


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map a requested backend to "torch" or "triton"; never switch silently.

    "auto": triton for CUDA tensors when triton is installed, the chunked torch path elsewhere.
    "triton": CUDA, or CPU only under TRITON_INTERPRET=1; otherwise a clear error.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError("backend='triton' requested but triton is not installed; "
                           "use backend='torch' or 'auto'")
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and interpreter_enabled():
        from hacpo.kernels import _logprobs_triton   # first triton import happens here
        _logprobs_triton.check_device(device)
        return "triton"
    raise RuntimeError(
        f"backend='triton' needs CUDA tensors (got device {device}); on CPU it runs only under "
        "TRITON_INTERPRET=1 set before triton is first imported. Use backend='torch' or 'auto'.")


def check_temperature(temperature: float) -> float:
    """1 / temperature for a real number > 0 (a Python or numpy number, a 0-dim tensor; not a
    string or a bool)."""
    if isinstance(temperature, (str, bytes, bool)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    t = float(temperature)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if 1.0 / t > torch.finfo(torch.float32).max:    # logits * (1/t) would be inf in float32
        raise ValueError(f"temperature {temperature!r} is too small: 1/temperature overflows "
                         f"float32")
    return 1.0 / t


def check_logits_targets(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V], got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits dtype must be float32/bfloat16/float16, got {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError(f"logits must have V >= 1 columns, got shape {tuple(logits.shape)}")
    check_targets(targets, logits.shape[0], logits.device)


def check_targets(targets: torch.Tensor, T: int, device: torch.device) -> None:
    if targets.dim() != 1:
        raise ValueError(f"targets must be [T], got shape {tuple(targets.shape)}")
    if targets.shape[0] != T:
        raise ValueError(f"length mismatch: targets has {targets.shape[0]} entries, "
                         f"logits/hidden have T={T} rows")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
    if targets.device != device:
        raise ValueError(f"targets on {targets.device}, logits on {device}")


def vocab_layout(v_local: int, group) -> tuple[int, int]:
    """(vocab_start, global V) for contiguous equal V-shards, Megatron's layout.

    Rank r of the group holds global token ids [r * v_local, (r + 1) * v_local).
    """
    if group is None:
        return 0, v_local
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return rank * v_local, world * v_local


def shard_status(v_local: int, group, device: torch.device) -> torch.Tensor | None:
    """Device tensor [2] = (widest, -narrowest) V-shard over the tp group, by one MAX all-reduce
    of 2 numbers (validation only; no host sync here), or None without a group. Shards of unequal
    width break the layout `vocab_layout` assumes and would give wrong log-probs silently."""
    if group is None:
        return None
    st = torch.tensor([v_local, -v_local], dtype=torch.long, device=device)
    dist.all_reduce(st, op=dist.ReduceOp.MAX, group=group)
    return st


class _NotDifferentiable(torch.autograd.Function):
    """Identity on `grad` whose own backward raises. Like `once_differentiable`'s error node, but
    connected to everything the gradient depends on (the saved inputs too, not only the
    upstream grads), so that a double backward is an error even when the upstream grad is a
    constant (e.g. `logp.sum()`), instead of silently missing the second-order terms."""

    @staticmethod
    def forward(ctx, grad, *depends_on):
        return grad

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError("hacpo.kernels log-prob functions are differentiable once: their "
                           "gradient is computed outside autograd, so a double backward "
                           "(create_graph=True, then differentiating the gradient) is not "
                           "supported; use the *_reference functions for higher-order gradients")


def not_differentiable(grads: tuple, depends_on: tuple) -> tuple:
    """Mark a custom backward's results as not differentiable (see `_NotDifferentiable`). A
    no-op in an ordinary backward (grad mode is off there); only create_graph=True builds the
    error nodes, and only for results whose inputs require grad."""
    deps = [t for t in depends_on if isinstance(t, torch.Tensor)]
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in deps):
        return grads
    return tuple(None if gr is None else _NotDifferentiable.apply(gr, *deps) for gr in grads)


def first_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the first True in a 1-D mask, or len(mask) if none; stays on device (no sync)."""
    n = mask.shape[0]
    idx = torch.arange(n, device=mask.device)
    sentinel = torch.full((1,), n, device=mask.device, dtype=idx.dtype)
    return torch.cat([torch.where(mask, idx, n), sentinel]).amin()


def token_status(targets: torch.Tensor, logp: torch.Tensor, v_global: int) -> torch.Tensor:
    """Device tensor [2]: first row with a target outside [0, V), first row with a non-finite
    log-prob (NaN/+inf logits in the row, or a -inf target logit). len(rows) means none."""
    bad_target = (targets < 0) | (targets >= v_global)
    return torch.stack([first_index(bad_target), first_index(~torch.isfinite(logp) & ~bad_target)])


def cu_seqlens_status(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """Device tensor [3]: cu_seqlens[0] != 0, cu_seqlens[-1] != T, first empty/negative sequence
    (len(seqs) if none). Shapes/dtype are checked eagerly (no device data needed)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError("cu_seqlens must be [S+1] with S >= 1, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    cu_seqlens = cu_seqlens.long()     # a uint8 difference would wrap a negative length
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.stack([(cu_seqlens[0] != 0).long(), (cu_seqlens[-1] != T).long(),
                        first_index(lengths <= 0)])


def raise_if_invalid(token_st: torch.Tensor | None, T: int, cu_st: torch.Tensor | None = None,
                     cu_seqlens: torch.Tensor | None = None,
                     shard_st: torch.Tensor | None = None) -> None:
    """The one host sync of validation: pull all flags in a single `.tolist()`.
    The shard check comes first: with unequal shards the other flags differ between ranks, while
    the shard flags are the same on every rank, so every rank raises the same error."""
    parts = [s.to(torch.long).cpu() if s.device.type != "cpu" else s.to(torch.long)
             for s in (shard_st, token_st, cu_st) if s is not None]
    flags = torch.cat(parts).tolist()
    if shard_st is not None:
        widest, narrowest = flags[0], -flags[1]
        flags = flags[2:]
        if widest != narrowest:
            raise ValueError(f"tp_group: the vocab shards are {narrowest} to {widest} columns "
                             "wide; they must be equal contiguous V-slices (rank r holds ids "
                             "[r * V/tp, (r + 1) * V/tp)): pad the vocabulary to a multiple of "
                             "the group size")
    if cu_st is not None:
        c0, clast, empty = flags[-3:]
        S = cu_seqlens.shape[0] - 1
        if c0:
            raise ValueError(f"cu_seqlens must start at 0, got {int(cu_seqlens[0])}")
        if clast:
            raise ValueError(f"cu_seqlens does not match T: cu_seqlens[-1]={int(cu_seqlens[-1])} "
                             f"but there are T={T} tokens")
        if empty < S:
            length = int(cu_seqlens[empty + 1]) - int(cu_seqlens[empty])   # not in uint8
            raise ValueError(f"sequence {empty} has length {length} (zero-length or decreasing "
                             "cu_seqlens): a sequence mean needs at least one token")
    if token_st is not None:
        bad_t, bad_f = flags[0], flags[1]
        if bad_t < T:
            raise ValueError(f"target out of range at row {bad_t}: the target id must be in [0, V)")
        if bad_f < T:
            raise ValueError(f"non-finite log-prob at row {bad_f}: the row's logits contain NaN or "
                             "+inf, or the target's logit is -inf")
