"""Per-token log-probabilities from logits, without a [T, V] float32 log-softmax.

    logp[t] = z[t, y_t] - logsumexp_v z[t, v],      z = logits / temperature     (logits: [T, V])
    d logp[t] / d logits[t, v] = (onehot(y_t)[v] - softmax(z[t])[v]) / temperature

Layout (Liger-style): `token_logprobs_reference` is the spec in plain torch; `_TokenLogProbs` is
the autograd.Function; `token_logprobs` / `sequence_mean_logprobs` are the thin public functions.
Two backends compute the *shard-local* row statistics (log-sum-exp, target logit, and the
softmax-weighted mean of z for the entropy):

- "torch": chunks over rows T; each chunk is upcast to float32 and reduced, so the float32
  working set is `rows_per_chunk * V`, independent of T. Default on CPU.
- "triton" (`_logprobs_triton.py`, imported lazily): one program per row, online max/sum-exp
  over V blocks; backward recomputes softmax in one pass from the saved per-row lse.

Vocab parallelism (`tp_group`): each rank holds a contiguous V-slice of the logits (targets are
global ids). The shard-local math above is communication-free; `_TokenLogProbs` combines the
partials with one MAX and one SUM all-reduce (as Megatron's `tensor_parallel/cross_entropy.py`).
The backward needs no communication: grad_local = g * (onehot_local - softmax_local) / temp.

Saved for backward: the logits (input, not a copy), targets and per-row (max, log-sum-exp
offset) [T] float32 each.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hacpo.kernels._common import (check_logits_targets, check_temperature, cu_seqlens_status,
                                   not_differentiable, raise_if_invalid, resolve_backend,
                                   shard_status, token_status, vocab_layout)

# Float32 elements per row-chunk of the torch path (16 MiB): big enough to amortise per-op
# overhead (measured: 4 MiB chunks were several times slower on 2 cores), small enough to keep
# the working set bounded and independent of T.
ROW_CHUNK_ELEMS = 1 << 22


# ----------------------------------------------------------------------------------------------
# Reference (the spec)
# ----------------------------------------------------------------------------------------------
def token_logprobs_reference(logits: torch.Tensor, targets: torch.Tensor, *,
                             temperature: float = 1.0,
                             compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """logits [T, V], targets [T] -> logp [T] in `compute_dtype`.

    Memory: reads logits [T, V] once; writes a [T, V] `compute_dtype` copy (the upcast, when the
    dtype differs), a [T, V] log-softmax (saved by autograd) and [T] outputs. Backward writes a
    [T, V] zero-filled scatter of the upstream grad plus a [T, V] grad. This is the memory the
    kernels avoid.
    """
    z = logits.to(compute_dtype) / temperature
    return torch.log_softmax(z, dim=-1).gather(-1, targets.long()[:, None]).squeeze(-1)


def token_entropy_reference(logits: torch.Tensor, *, temperature: float = 1.0,
                            compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """logits [T, V] -> entropy [T] of softmax(logits / temperature). Memory: 2 [T, V] temps."""
    logp = torch.log_softmax(logits.to(compute_dtype) / temperature, dim=-1)
    return -(logp.exp() * logp).nan_to_num(nan=0.0).sum(-1)


def sequence_mean_logprobs_reference(logits: torch.Tensor, targets: torch.Tensor,
                                     cu_seqlens: torch.Tensor, *, temperature: float = 1.0,
                                     compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed sequences: sequence s owns rows cu_seqlens[s]:cu_seqlens[s+1] -> mean logp [S].
    Memory: that of `token_logprobs_reference`, plus S means (reads cu_seqlens on the host)."""
    lp = token_logprobs_reference(logits, targets, temperature=temperature,
                                  compute_dtype=compute_dtype)
    bounds = cu_seqlens.tolist()
    return torch.stack([lp[a:b].mean() for a, b in zip(bounds[:-1], bounds[1:])])


# ----------------------------------------------------------------------------------------------
# Shard-local math (no communication). Row statistics of z = logits * inv_temp over this shard:
#   m [T]:    row max (-inf if the shard's row is all -inf)
#   ls [T]:   log sum_v exp(z_v - m)   (so lse = m + ls; kept apart so that logp = (z_y - m) - ls
#             keeps fp32 accuracy for |z| ~ 1e4, as log_softmax does)
#   tgt [T]:  z[t, y_t - vocab_start] if the target falls in the shard, else 0
#   ez [T]:   sum_v softmax_local(z)_v * (z_v - m), for the entropy; 0 if the row is all -inf
# ----------------------------------------------------------------------------------------------
def _rows_per_chunk(V: int) -> int:
    return max(1, ROW_CHUNK_ELEMS // max(V, 1))


def local_stats_torch(logits: torch.Tensor, tlocal: torch.Tensor, inv_temp: float,
                      need_entropy: bool):
    """logits [T, V_local], tlocal [T] (target - vocab_start) -> (m, ls, tgt, ez) [T] f32 each."""
    T, V = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    m, ls, tgt = torch.empty(T, **f32), torch.empty(T, **f32), torch.empty(T, **f32)
    ez = torch.empty(T, **f32) if need_entropy else None
    in_shard = (tlocal >= 0) & (tlocal < V)
    idx = tlocal.clamp(0, V - 1)[:, None]
    step = _rows_per_chunk(V)
    for r0 in range(0, T, step):
        r1 = min(r0 + step, T)
        z = logits[r0:r1].float()                       # a view when logits are float32
        if inv_temp != 1.0:                             # never scale the caller's logits in place
            z = z.mul(inv_temp) if logits.dtype == torch.float32 else z.mul_(inv_temp)
        m_c = z.amax(dim=-1)
        m_safe = torch.where(m_c == float("-inf"), 0.0, m_c)
        e = torch.sub(z, m_safe[:, None]).exp_()
        s_c = e.sum(-1)
        m[r0:r1], ls[r0:r1] = m_c, torch.log(s_c)
        tgt[r0:r1] = z.gather(1, idx[r0:r1]).squeeze(1)
        if need_entropy:
            pz = (e * torch.where(e > 0, z - m_safe[:, None], 0.0)).sum(-1)
            ez[r0:r1] = torch.where(s_c > 0, pz / s_c, 0.0)
    tgt = torch.where(in_shard, tgt, 0.0)
    return m, ls, tgt, ez


def local_grad_torch(logits: torch.Tensor, tlocal: torch.Tensor, m: torch.Tensor,
                     ls: torch.Tensor, grad: torch.Tensor, inv_temp: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """dlogits [T, V] in logits.dtype = grad * (onehot - exp(z - m - ls)) * inv_temp, by row-chunk.
    (m, ls) are the *global* row max and log-sum-exp offset (after the vocab-parallel combine).

    Three passes per chunk: (z - m), exp, times the row factor -g * inv_temp * exp(-ls) (folding
    exp(-ls) into the factor saves a pass and keeps (z - m) exact for |z| ~ 1e4).
    out: where to write (may be `logits` itself when the caller no longer needs them)."""
    T, V = logits.shape
    if out is None:
        out = torch.empty((T, V), dtype=logits.dtype, device=logits.device)
    in_shard = (tlocal >= 0) & (tlocal < V)
    idx = tlocal.clamp(0, V - 1)[:, None]
    gs = grad.float() * inv_temp                      # [T] scale of the row's gradient
    row_factor = (-gs * torch.exp(-ls))[:, None]      # -g / temp / sum_v exp(z_v - m)
    g_tgt = torch.where(in_shard, gs, 0.0)[:, None]
    fp32 = logits.dtype == torch.float32
    step = _rows_per_chunk(V)
    for r0 in range(0, T, step):
        r1 = min(r0 + step, T)
        x, mc = logits[r0:r1], m[r0:r1, None]
        if inv_temp != 1.0:
            buf = torch.mul(x, inv_temp, out=out[r0:r1]) if fp32 else x.float().mul_(inv_temp)
            buf.sub_(mc)
        elif fp32:
            buf = torch.sub(x, mc, out=out[r0:r1])      # compute in place in the output
        else:
            buf = torch.sub(x, mc)                      # bf16 - f32 tensor: computed in fp32
        buf.exp_().mul_(row_factor[r0:r1])
        buf.scatter_add_(1, idx[r0:r1], g_tgt[r0:r1])
        if not fp32:
            out[r0:r1].copy_(buf)
    return out


def local_stats(backend: str, logits, tlocal, inv_temp, need_entropy):
    if backend == "triton":
        from hacpo.kernels import _logprobs_triton
        return _logprobs_triton.local_stats(logits, tlocal, inv_temp, need_entropy)
    return local_stats_torch(logits, tlocal, inv_temp, need_entropy)


def local_grad(backend: str, logits, tlocal, m, ls, grad, inv_temp, out=None):
    if backend == "triton":
        from hacpo.kernels import _logprobs_triton
        return _logprobs_triton.local_grad(logits, tlocal, m, ls, grad, inv_temp, out=out)
    return local_grad_torch(logits, tlocal, m, ls, grad, inv_temp, out=out)


def _shard_weights(m_local, ls_local, ez_local, m_global):
    """Per-shard terms of the combine (no communication): w = sum_v exp(z_v - M) over the shard,
    and w * E_shard[z - M] for the entropy. All [T] (or [R, T] with shards stacked on dim 0)."""
    mg = torch.where(torch.isfinite(m_global), m_global, 0.0)
    w = torch.exp(m_local - mg + ls_local)                # 0 for an all -inf shard row
    wz = None
    if ez_local is not None:
        wz = torch.where(w > 0, w * (ez_local + m_local - mg), 0.0)
    return mg, w, wz


def combine_stats(m_parts, ls_parts, tgt_parts, ez_parts=None):
    """Communication-free combine of per-shard partials stacked on dim 0 ([R, T] each): the math
    that `allreduce_stats` implements with collectives. Returns global (m, ls, tgt, ez)."""
    mg, w, wz = _shard_weights(m_parts, ls_parts, ez_parts, m_parts.amax(0))
    s = w.sum(0)
    return mg, torch.log(s), tgt_parts.sum(0), (None if wz is None else wz.sum(0) / s)


def allreduce_stats(m, ls, tgt, ez, group):
    """Vocab-parallel combine: one MAX and one SUM all-reduce of [T]-sized partials over the tp
    group (the only collectives of the forward). Same math as `combine_stats`."""
    if group is None:
        return m, ls, tgt, ez
    m_global = m.clone()
    dist.all_reduce(m_global, op=dist.ReduceOp.MAX, group=group)
    mg, w, wz = _shard_weights(m, ls, ez, m_global)
    buf = torch.stack([w, tgt] + ([wz] if wz is not None else []))
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return mg, torch.log(buf[0]), buf[1], (buf[2] / buf[0] if wz is not None else None)


def finish(m, ls, tgt, ez):
    """[T] stats -> logp = (z_y - m) - ls [T]; entropy = ls - E[z - m] [T] (or None)."""
    logp = (tgt - m) - ls
    return logp, (None if ez is None else ls - ez)


class _TokenLogProbs(torch.autograd.Function):
    """logits [T, V_local] -> (logp [T] f32, entropy [T] f32 or empty).

    Only logp is differentiable; entropy is a metric (no gradient). Differentiable once: the
    backward is not itself differentiable (double backward raises instead of dropping terms)."""

    @staticmethod
    def forward(ctx, logits, targets, inv_temp, backend, group, need_entropy):
        vocab_start, _ = vocab_layout(logits.shape[1], group)
        tlocal = targets.long() - vocab_start if vocab_start else targets.long()
        m, ls, tgt, ez = allreduce_stats(*local_stats(backend, logits, tlocal, inv_temp,
                                                      need_entropy), group)
        logp, ent = finish(m, ls, tgt, ez)
        ent = ent if need_entropy else logp.new_empty(0)
        ctx.save_for_backward(logits, tlocal, m, ls)
        ctx.inv_temp, ctx.backend = inv_temp, backend
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g, _g_ent):
        logits, tlocal, m, ls = ctx.saved_tensors
        if g is None or not ctx.needs_input_grad[0]:
            return (None,) * 6
        with torch.no_grad():        # create_graph=True: still no graph through the kernels
            dlogits = local_grad(ctx.backend, logits, tlocal, m, ls, g.contiguous(),
                                 ctx.inv_temp)
        dlogits, = not_differentiable((dlogits,), (logits, g))
        return dlogits, None, None, None, None, None


def _prepare(logits, targets, temperature, backend):
    check_logits_targets(logits, targets)
    inv_temp = check_temperature(temperature)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return logits, inv_temp, resolve_backend(backend, logits.device)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   backend: str = "auto", tp_group=None, return_entropy: bool = False,
                   validate: bool = True):
    """logits [T, V] (fp32/bf16/fp16; [T, V/tp] with `tp_group`), targets [T] global ids ->
    logp [T] float32, differentiable w.r.t. logits (grad written in logits.dtype).

    return_entropy: also return the per-token entropy [T] float32 (a metric, not differentiable).
    validate: one host sync that raises ValueError for a target outside [0, V) or a non-finite
    log-prob (NaN/+inf logits, -inf target logit), naming the first bad row, and with
    `tp_group` for V-shards of unequal width (one extra all-reduce of 2 numbers). Pass False in
    a hot loop to skip the sync.
    """
    logits, inv_temp, be = _prepare(logits, targets, temperature, backend)
    shard_st = shard_status(logits.shape[1], tp_group, logits.device) if validate else None
    logp, ent = _TokenLogProbs.apply(logits, targets, inv_temp, be, tp_group, return_entropy)
    if validate:
        _, v_global = vocab_layout(logits.shape[1], tp_group)
        raise_if_invalid(token_status(targets, logp.detach(), v_global), logits.shape[0],
                         shard_st=shard_st)
    return (logp, ent) if return_entropy else logp


def segment_mean(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """values [T], cu_seqlens [S+1] -> per-segment mean [S]; no host sync, differentiable."""
    T = values.shape[0]
    cu = cu_seqlens.to(device=values.device, dtype=torch.long)
    seg = torch.searchsorted(cu[1:], torch.arange(T, device=values.device), right=True)
    seg = seg.clamp_(max=cu.shape[0] - 2)
    sums = values.new_zeros(cu.shape[0] - 1).index_add(0, seg, values)
    return sums / (cu[1:] - cu[:-1]).to(values.dtype)


def sequence_mean_logprobs(logits: torch.Tensor, targets: torch.Tensor, cu_seqlens: torch.Tensor,
                           *, temperature: float = 1.0, backend: str = "auto", tp_group=None,
                           return_entropy: bool = False, validate: bool = True):
    """Packed sequences: logits [T, V], targets [T], cu_seqlens [S+1] (sequence s owns rows
    cu_seqlens[s]:cu_seqlens[s+1]) -> mean token log-prob per sequence [S] float32.

    return_entropy: also return the per-token entropy [T] (metric, not differentiable).
    validate: one combined host sync for targets, non-finite rows, cu_seqlens (0 start,
    ends at T, no zero-length sequence) and, with `tp_group`, equal V-shards.
    """
    logits, inv_temp, be = _prepare(logits, targets, temperature, backend)
    cu_st = cu_seqlens_status(cu_seqlens, logits.shape[0])    # shape checks are eager
    shard_st = shard_status(logits.shape[1], tp_group, logits.device) if validate else None
    logp, ent = _TokenLogProbs.apply(logits, targets, inv_temp, be, tp_group, return_entropy)
    if validate:
        _, v_global = vocab_layout(logits.shape[1], tp_group)
        raise_if_invalid(token_status(targets, logp.detach(), v_global), logits.shape[0],
                         cu_st, cu_seqlens, shard_st=shard_st)
    out = segment_mean(logp, cu_seqlens)
    return (out, ent) if return_entropy else out
