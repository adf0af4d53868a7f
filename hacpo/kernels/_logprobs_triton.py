"""Triton kernels for `hacpo.kernels.logprobs` (imported lazily: importing this module imports
triton, so under the interpreter TRITON_INTERPRET=1 must be set before the first import).

Forward, one program per row: online max / rescaled sum-exp over BLOCK_V columns at a time,
plus a gather of the target's logit. Reads the row once (V * elem bytes), writes 2-3 floats.
Backward, one program per row: dlogits = g * (onehot - exp(z - m - ls)) * inv_temp recomputed from
the saved per-row max m and log-sum-exp offset ls in one pass; reads the row once, writes it
once. No softmax is stored.

Interpreter-safe: every load is followed by `.to(tl.float32)`, only tl.exp2/tl.log (no libdevice),
a single fixed config (no multi-config autotune).

Instruction economy (the forward must stream bf16 rows at most of HBM bandwidth, so the
per-element work is what limits it): exponentials are ``exp2(y * LOG2E)``, a bare hardware ex2
(``tl.exp`` compiles to an ex2 plus a per-element denormal fix-up); the block max is taken on
the raw logits and scaled once; with the entropy both block sums are one two-operand
reduction; the backward compares the target as int32. Compiled for sm_90 with triton 3.7.1
(no GPU: ptxas / cuobjdump only) these cut the SASS instructions per loop iteration from 248 to
182 (bf16 forward), 322 to 250 (with entropy) and 276 to 191 (bf16 backward), loads still
128-bit, no register spills (32 registers per thread; 47 with the entropy, 40 for the fp32
backward); measured speed needs a GPU (benchmarks/gpu_check.sh).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreter_active() -> bool:
    """True when triton's own jit functions (tl.max, ...) were created in interpreter mode, i.e.
    TRITON_INTERPRET=1 was set before triton was first imported in this process."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(tl.max, InterpretedFunction)


def check_device(device: torch.device) -> None:
    if device.type == "cpu" and not interpreter_active():
        raise RuntimeError(
            "backend='triton' on CPU needs the Triton interpreter, but triton was imported before "
            f"TRITON_INTERPRET=1 was set (now {os.environ.get('TRITON_INTERPRET')!r}); set it "
            "before anything imports triton, or use backend='torch'")


LOG2E = tl.constexpr(1.4426950408889634)    # exp(y) = exp2(y * LOG2E)


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _logprob_fwd_kernel(X, stride_x, TGT, M, LS, TGT_LOGIT, EZ, V, inv_temp,
                        BLOCK_V: tl.constexpr, ENTROPY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)           # row * stride can exceed 2**31
    x_ptr = X + row * stride_x
    m = float("-inf")                              # running max of z = x * inv_temp
    s = 0.0                                        # sum exp(z - m)
    w = 0.0                                        # sum exp(z - m) * (z - m)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        x = tl.load(x_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        # max of the raw logits, scaled once (inv_temp > 0): no scaled copy of the block
        m_new = tl.maximum(m, tl.max(x, axis=0) * inv_temp)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # all -inf so far: avoid inf-inf
        m_old = tl.where(m == float("-inf"), m_safe, m)
        scale = tl.exp2((m_old - m_safe) * LOG2E)
        y = x * inv_temp - m_safe
        p = tl.exp2(y * LOG2E)     # a bare ex2 (tl.exp adds a denormal-range fix-up per element)
        if ENTROPY:
            # running sum of exp(z - m) * (z - m), rebased from m_old to m_new; both sums in
            # one two-operand reduction (one pass of barriers instead of two)
            ps, pw = tl.reduce((p, p * tl.where(x == float("-inf"), 0.0, y)), 0, _add2)
            w = scale * (w + (m_old - m_safe) * s) + pw
        else:
            ps = tl.sum(p, axis=0)
        s = s * scale + ps
        m = m_new
    tl.store(M + row, m)
    tl.store(LS + row, tl.log(s))                 # -inf when the (shard's) row is all -inf
    t = tl.load(TGT + row)
    in_shard = (t >= 0) & (t < V)
    t_safe = tl.where(in_shard, t, 0)
    xt = tl.load(x_ptr + t_safe).to(tl.float32) * inv_temp
    tl.store(TGT_LOGIT + row, tl.where(in_shard, xt, 0.0))
    if ENTROPY:
        tl.store(EZ + row, tl.where(s > 0, w / s, 0.0))


@triton.jit
def _logprob_bwd_kernel(X, stride_x, DX, stride_dx, TGT, M, LS, G, V, inv_temp,
                        BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_ptr = X + row * stride_x
    dx_ptr = DX + row * stride_dx
    t = tl.load(TGT + row)
    # the target as an int32 column (-1: not in this shard), compared with the int32 offsets
    t32 = tl.where((t >= 0) & (t < V), t, -1).to(tl.int32)
    m = tl.load(M + row)
    ls = tl.load(LS + row)
    gs = tl.load(G + row).to(tl.float32) * inv_temp
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inv_temp
        p = tl.exp2(((x - m) - ls) * LOG2E)
        d = (tl.where(offs == t32, 1.0, 0.0) - p) * gs
        tl.store(dx_ptr + offs, d.to(DX.dtype.element_ty), mask=mask)


def _config(V: int):
    block = min(triton.next_power_of_2(max(V, 16)), 4096)
    return block, (8 if block >= 2048 else 4)


def local_stats(logits: torch.Tensor, tlocal: torch.Tensor, inv_temp: float, need_entropy: bool):
    T, V = logits.shape
    dev = logits.device
    m, ls, tgt = (torch.empty(T, dtype=torch.float32, device=dev) for _ in range(3))
    ez = torch.empty(T if need_entropy else 1, dtype=torch.float32, device=dev)
    if T > 0:
        block, warps = _config(V)
        _logprob_fwd_kernel[(T,)](logits, logits.stride(0), tlocal.contiguous(), m, ls, tgt, ez,
                                  V, float(inv_temp), BLOCK_V=block, ENTROPY=need_entropy,
                                  num_warps=warps)
    return m, ls, tgt, (ez if need_entropy else None)


def local_grad(logits: torch.Tensor, tlocal: torch.Tensor, m: torch.Tensor, ls: torch.Tensor,
               grad: torch.Tensor, inv_temp: float, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """out may alias logits (each program loads a block before storing the same block)."""
    T, V = logits.shape
    if out is None:
        out = torch.empty((T, V), dtype=logits.dtype, device=logits.device)
    if T == 0:
        return out
    block, warps = _config(V)
    _logprob_bwd_kernel[(T,)](logits, logits.stride(0), out, out.stride(0), tlocal.contiguous(),
                              m.contiguous(), ls.contiguous(), grad.float().contiguous(), V,
                              float(inv_temp),
                              BLOCK_V=block, num_warps=warps)
    return out
