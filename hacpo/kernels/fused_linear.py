"""Token log-probs straight from the last hidden states and the lm_head weight.

    logits = hidden @ weight.T        (hidden [T, H], weight [V, H])
    logp = log_softmax(logits / temp)[y]

The full [T, V] logits never exist: the Function walks T in chunks of `chunk_size` rows, forms
the chunk's logits [C, V] in the input dtype (as the model's lm_head would), reduces them with
the same shard-local row statistics as `logprobs.py` (torch or triton backend) and keeps only the
per-row lse [T] float32. The backward recomputes each chunk's logits and turns them into
dlogits [C, V], then grad_hidden[chunk] = dlogits @ weight and grad_weight += dlogits.T @ hidden.

Vocab parallel (`tp_group`): weight [V/tp, H] is this rank's contiguous V-slice, hidden is
replicated. Forward: one MAX and one SUM all-reduce of [T]-sized partials (after all chunks).
Backward: grad_weight is shard-local; grad_hidden is a sum over V, so it is all-reduced (SUM)
inside the Function (the job Megatron's copy-to-tensor-parallel-region does for a column-parallel
lm_head).

Padded vocabulary (`vocab_size`): a weight padded to more rows than the real vocabulary (Megatron
pads V to a multiple of TP; the padding rows are the last global ids) has the logit columns of
ids >= vocab_size set to -inf in every chunk, forward and backward: they get probability 0 and
zero gradient, and the log-probs are those of the real vocab_size-way softmax.

Autocast: under `torch.autocast` the chunk logits are formed in the autocast dtype (as the
model's lm_head would), and the backward recomputes them under that same autocast state, so the
recomputed softmax matches the forward's lse; dlogits and the grad_hidden / grad_weight GEMMs
are in the inputs' dtype (one more [C, V] buffer then).

Memory: saved for backward = hidden, weight (inputs, not copies), targets, and the row max and
log-sum-exp offset [T] f32 each. Peak extra = one chunk of logits [C, V] in the input dtype
(overwritten in place by its dlogits in backward) + the torch path's float32 row-chunk, plus a
float32 [V, H] grad_weight accumulator when the weight is bf16/fp16.
"""
from __future__ import annotations

import contextlib
import numbers

import torch
import torch.distributed as dist

from hacpo.kernels._common import (check_targets, check_temperature, not_differentiable,
                                   raise_if_invalid, resolve_backend, shard_status, token_status,
                                   vocab_layout)
from hacpo.kernels.logprobs import (allreduce_stats, finish, local_grad, local_stats,
                                    token_logprobs_reference)


def fused_linear_token_logprobs_reference(hidden, weight, targets, *, temperature: float = 1.0,
                                          compute_dtype: torch.dtype = torch.float32,
                                          vocab_size: int | None = None):
    """Spec: materialises logits [T, V] in compute_dtype (reads hidden + weight, writes T*V);
    rows of weight past ``vocab_size`` (padding) are left out."""
    if vocab_size is not None:
        weight = weight[:vocab_size]
    logits = hidden.to(compute_dtype) @ weight.to(compute_dtype).t()
    return token_logprobs_reference(logits, targets, temperature=temperature,
                                    compute_dtype=compute_dtype)


def default_chunk_size(T: int, v_local: int, device: torch.device) -> int:
    # Elements of one chunk's logits: 64 Mi on GPU, 32 Mi on CPU. Each chunk re-reads the whole
    # weight, so chunks must be tall enough to amortise it (measured on CPU: 64-row chunks at
    # V=65536, H=1024 were 2.5x slower than the unchunked matmul; 512 rows are not).
    budget = 1 << 26 if device.type == "cuda" else 1 << 25
    return max(1, min(max(T, 1), budget // max(v_local, 1)))


def _autocast_dtype(device: torch.device):
    """The dtype autocast casts matmuls to on `device` right now, or None (off / unsupported)."""
    dev = device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return None


def _autocast_as_in_forward(device: torch.device, dtype):
    """Context for the backward's logits recompute: the forward's autocast state (dtype, or off
    when None), whatever autocast state the backward itself runs under."""
    if not torch.amp.is_autocast_available(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


class _FusedLinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, chunk, backend, group, need_entropy,
                n_valid):
        T = hidden.shape[0]
        vocab_start, _ = vocab_layout(weight.shape[0], group)
        tlocal = targets.long() - vocab_start if vocab_start else targets.long()
        f32 = dict(dtype=torch.float32, device=hidden.device)
        stats = [torch.empty(T, **f32) for _ in range(4 if need_entropy else 3)]
        for c0 in range(0, T, chunk):
            c1 = min(c0 + chunk, T)
            logits = hidden[c0:c1] @ weight.t()
            if n_valid < logits.shape[1]:
                logits[:, n_valid:] = float("-inf")        # padded vocabulary columns
            parts = local_stats(backend, logits, tlocal[c0:c1], inv_temp, need_entropy)
            for buf, part in zip(stats, parts):
                buf[c0:c1] = part
            del logits
        m, ls, tgt, ez = allreduce_stats(*stats, *([None] * (4 - len(stats))), group)
        logp, ent = finish(m, ls, tgt, ez)
        ent = ent if need_entropy else logp.new_empty(0)
        ctx.save_for_backward(hidden, weight, tlocal, m, ls)
        ctx.cfg = (inv_temp, chunk, backend, group, n_valid)
        ctx.autocast_dtype = _autocast_dtype(hidden.device)   # the chunk logits' dtype if set
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g, _g_ent):
        with torch.no_grad():        # create_graph=True: still no graph through the kernels
            grad_h, grad_w = _FusedLinearLogProbs._grads(ctx, g)
        hidden, weight = ctx.saved_tensors[:2]
        grad_h, grad_w = not_differentiable((grad_h, grad_w), (hidden, weight, g))
        return grad_h, grad_w, None, None, None, None, None, None, None

    @staticmethod
    def _grads(ctx, g):
        hidden, weight, tlocal, m, ls = ctx.saved_tensors
        inv_temp, chunk, backend, group, n_valid = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = None
        if need_w:
            acc_dtype = torch.float32   # accumulate over chunks in fp32 for bf16/fp16 weights
            grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device)
        g = g.contiguous()
        T = hidden.shape[0]
        for c0 in range(0, T, chunk):
            c1 = min(c0 + chunk, T)
            h = hidden[c0:c1]
            with _autocast_as_in_forward(hidden.device, ctx.autocast_dtype):
                logits = h @ weight.t()                    # the forward's logits, bit for bit
            if n_valid < logits.shape[1]:
                logits[:, n_valid:] = float("-inf")        # -> zero dlogits there
            # dlogits overwrite the recomputed chunk logits: one [C, V] buffer per chunk (under
            # autocast the logits are in its dtype: dlogits get their own buffer in the inputs')
            out = logits if logits.dtype == weight.dtype else torch.empty(
                logits.shape, dtype=weight.dtype, device=logits.device)
            dl = local_grad(backend, logits, tlocal[c0:c1], m[c0:c1], ls[c0:c1], g[c0:c1],
                            inv_temp, out=out)
            del logits, out
            if need_h:
                torch.mm(dl, weight, out=grad_h[c0:c1])
            if need_w:
                if dl.dtype == torch.float32:
                    grad_w.addmm_(dl.t(), h)
                else:
                    grad_w.add_(dl.t() @ h)
        if need_h and group is not None:
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=group)
        if need_w and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w


def fused_linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                *, temperature: float = 1.0, chunk_size: int | None = None,
                                backend: str = "auto", tp_group=None, return_entropy: bool = False,
                                validate: bool = True, vocab_size: int | None = None):
    """hidden [T, H], weight [V, H] ([V/tp, H] with `tp_group`), targets [T] global ids ->
    logp [T] float32, differentiable w.r.t. hidden and weight (grads in their dtypes).

    chunk_size: rows of T per chunk (None: about 32 Mi logits per chunk on CPU, 64 Mi on CUDA;
    any value >= T is one chunk).
    return_entropy: also return the per-token entropy [T] (metric, not differentiable).
    validate: one host sync; ValueError naming the first bad row (target outside [0, V),
    non-finite log-prob), and with `tp_group` for weight shards of unequal V (one extra
    all-reduce of 2 numbers).
    vocab_size: the real vocabulary when weight is padded (global ids >= vocab_size are padding
    rows: logit -inf, zero gradient); None: every row is real.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden [T, H] and weight [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden dtype {hidden.dtype} != weight dtype {weight.dtype}")
    if hidden.device != weight.device:
        raise ValueError(f"hidden on {hidden.device}, weight on {weight.device}")
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32/bfloat16/float16, got {hidden.dtype}")
    check_targets(targets, hidden.shape[0], hidden.device)
    inv_temp = check_temperature(temperature)
    be = resolve_backend(backend, hidden.device)
    T = hidden.shape[0]
    v_start, v_global = vocab_layout(weight.shape[0], tp_group)
    if vocab_size is None:
        vocab_size = v_global
    elif isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
        raise ValueError(f"vocab_size must be a whole number, got {vocab_size!r}")
    elif not 1 <= int(vocab_size) <= v_global:
        where = " over the TP group" if tp_group is not None else ""
        raise ValueError(f"vocab_size must be in [1, {v_global}] (the rows of weight{where}), "
                         f"got {vocab_size}")
    n_valid = min(max(int(vocab_size) - v_start, 0), weight.shape[0])
    if n_valid == 0:
        raise ValueError(f"this rank's vocabulary shard (ids {v_start}.."
                         f"{v_start + weight.shape[0] - 1}) holds only padding "
                         f"(vocab_size {vocab_size})")
    if chunk_size is None:
        chunk_size = default_chunk_size(T, weight.shape[0], hidden.device)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or \
            chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    shard_st = shard_status(weight.shape[0], tp_group, hidden.device) if validate else None
    logp, ent = _FusedLinearLogProbs.apply(hidden, weight, targets, inv_temp, int(chunk_size), be,
                                           tp_group, return_entropy, n_valid)
    if validate:
        raise_if_invalid(token_status(targets, logp.detach(), int(vocab_size)), T,
                         shard_st=shard_st)
    return (logp, ent) if return_entropy else logp
