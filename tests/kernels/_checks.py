"""Correctness checks for hacpo.kernels, free of pytest so that `benchmarks/gpu_correctness.py`
can run the same checks on a GPU machine without pytest. Each check raises AssertionError with
the measured errors; the pytest files only choose parameters.

Three-way tolerance (Liger style): truth = the reference in float64 on the *same* (possibly
bf16-rounded) inputs; "ref-lowp" = the reference computed in the input's dtype; "kernel" = ours on
the input dtype. We assert  err(kernel) <= K * err(ref-lowp) + atol  for values and gradients.
"""
from __future__ import annotations

import math

import torch

from hacpo.kernels import (fused_linear_token_logprobs, fused_linear_token_logprobs_reference,
                           sequence_mean_logprobs, sequence_mean_logprobs_reference,
                           token_entropy_reference, token_logprobs, token_logprobs_reference)

EPS32 = 2.0 ** -23
# K: the kernel may be at most twice as far from the truth as the reference computed in the same
# low precision (different but equally valid summation orders differ by ~1x; 2x is headroom, a
# real bug - wrong temperature, wrong row, wrong lse - is off by orders of magnitude).
K = 2.0


def _max_err(a: torch.Tensor, truth: torch.Tensor) -> float:
    a, truth = a.detach().double(), truth.detach().double()
    both_inf = torch.isinf(a) & torch.isinf(truth) & (torch.sign(a) == torch.sign(truth))
    d = torch.where(both_inf, 0.0, (a - truth).abs())
    return float(d.nan_to_num(nan=float("inf")).max()) if d.numel() else 0.0


def finite_absmax(x: torch.Tensor) -> float:
    """Largest finite |x| (0 if none). make_logits' row 0 is -inf outside its target: a plain
    ``x.abs().max()`` is inf there, and a tolerance scaled by it (fp32_atol(inf) = inf) could
    never fail."""
    a = x.detach().float().abs()
    a = a[torch.isfinite(a)]
    return float(a.max()) if a.numel() else 0.0


def fp32_atol(magnitude: float, ulps: float = 16.0) -> float:
    """A few float32 ulps of the largest magnitude involved. The kernels compute in float32 from
    the exact input values, so their error vs a float64 truth is a handful of fp32 roundings of
    the largest |z| or |lse| (the subtraction z - lse); 16 ulps covers the summation over V.
    A non-finite magnitude is an error: the tolerance would be inf and could never fail."""
    if not math.isfinite(magnitude):
        raise ValueError(f"fp32_atol of a non-finite magnitude {magnitude} (use finite_absmax)")
    return ulps * EPS32 * max(1.0, magnitude)


def make_logits(T, V, dtype, device, *, scale=3.0, seed=0, special_rows=True):
    """Random logits [T, V] in `dtype` and targets [T]. special_rows: row 0 is all -inf except its
    target; row 1 is +-1e4 (extreme but finite); row 2 has its target at the max."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, V, generator=g, dtype=torch.float32) * scale
    t = torch.randint(0, V, (T,), generator=g)
    if special_rows and T >= 3:
        x[0] = float("-inf")
        x[0, t[0]] = 0.5
        x[1] = torch.sign(torch.randn(V, generator=g)) * 1e4
        x[2, t[2]] = x[2].max() + 1.0
    return x.to(dtype).to(device), t.to(device)


def _lowp_reference_grad(fn, x, g):
    """(out, d out/d x . g) with the gradient in x's dtype (pass x.double() for the truth)."""
    xl = x.detach().clone().requires_grad_()
    out = fn(xl)
    out.backward(g.to(out.dtype))
    return out.detach(), xl.grad


def check_token_logprobs(*, backend, device, dtype, T, V, temperature=1.0, scale=3.0, seed=0,
                         special_rows=True):
    x, t = make_logits(T, V, dtype, device, scale=scale, seed=seed, special_rows=special_rows)
    g = torch.randn(T, generator=torch.Generator().manual_seed(seed + 1)).to(device)

    truth, gtruth = _lowp_reference_grad(
        lambda z: token_logprobs_reference(z.double(), t, temperature=temperature,
                                           compute_dtype=torch.float64), x.double(), g.double())
    ref, gref = _lowp_reference_grad(
        lambda z: token_logprobs_reference(z, t, temperature=temperature, compute_dtype=dtype),
        x, g)
    xk = x.detach().clone().requires_grad_()
    out = token_logprobs(xk, t, temperature=temperature, backend=backend)
    out.backward(g)
    assert out.dtype == torch.float32 and xk.grad.dtype == dtype

    zmax = finite_absmax(x) / temperature
    e_k, e_r = _max_err(out, truth), _max_err(ref, truth)
    # forward: kernel upcasts, so it is fp32-accurate whatever the input dtype - per row, a few
    # fp32 ulps of that row's largest |z| (so the +-1e4 row does not loosen the other rows)
    row_zmax = x.float().abs().nan_to_num(posinf=0.0).amax(1).double() / temperature
    row_bound = 16.0 * EPS32 * row_zmax.clamp_min(1.0)
    row_err = (out.detach().double() - truth).abs().nan_to_num(nan=float("inf"))
    row_err = torch.where(torch.isinf(out) & torch.isinf(truth), 0.0, row_err)
    worst = int((row_err / row_bound).argmax())
    assert bool((row_err <= row_bound).all()), \
        f"fwd {dtype}: row {worst} kernel err {float(row_err[worst]):.3g} > fp32 bound"
    assert e_k <= K * e_r + fp32_atol(zmax), f"fwd: kernel err {e_k:.3g} vs ref-lowp {e_r:.3g}"

    gmax = float(gtruth.abs().max())
    ge_k, ge_r = _max_err(xk.grad, gtruth), _max_err(gref, gtruth)
    # grad: written in the input dtype, so one final rounding (half an ulp: 2^-8 relative for
    # bf16's 8-bit mantissa, 2^-11 for fp16) on top of the fp32 math; fp32 gets a few ulps.
    round_tol = {torch.float32: fp32_atol(gmax), torch.bfloat16: 2.0 ** -8 * gmax,
                 torch.float16: 2.0 ** -11 * gmax + 2.0 ** -24}[dtype]
    assert ge_k <= K * ge_r + round_tol, \
        f"grad {dtype}: kernel err {ge_k:.3g} vs ref-lowp {ge_r:.3g} (+{round_tol:.3g})"
    # absolute bound: softmax = exp(z - lse) carries the fp32 error of its argument (a few ulps
    # of |z|) as a relative error, times |g| / temp <= gmax; plus the output rounding.
    assert ge_k <= 2 * round_tol + gmax * fp32_atol(zmax), \
        f"grad {dtype}: kernel err {ge_k:.3g} above output rounding {round_tol:.3g}"
    return dict(fwd_err=e_k, fwd_ref_err=e_r, grad_err=ge_k, grad_ref_err=ge_r)


def check_sequence_mean(*, backend, device, dtype, T, V, S, temperature=1.0, seed=0):
    x, t = make_logits(T, V, dtype, device, seed=seed, special_rows=True)
    gen = torch.Generator().manual_seed(seed + 2)
    cuts = torch.randperm(T - 1, generator=gen)[: S - 1].add(1).sort().values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([T])]).to(device)
    gs = torch.randn(S, generator=gen).to(device)
    truth, gtruth = _lowp_reference_grad(
        lambda z: sequence_mean_logprobs_reference(z.double(), t, cu, temperature=temperature,
                                                   compute_dtype=torch.float64), x.double(),
        gs.double())
    xk = x.detach().clone().requires_grad_()
    out = sequence_mean_logprobs(xk, t, cu, temperature=temperature, backend=backend)
    out.backward(gs)
    assert out.shape == (S,) and out.dtype == torch.float32
    zmax = finite_absmax(x) / temperature
    e = _max_err(out, truth)
    assert e <= fp32_atol(zmax), f"seq-mean fwd err {e:.3g}"
    gmax = float(gtruth.abs().max())
    tol = {torch.float32: fp32_atol(gmax), torch.bfloat16: 2.0 ** -8 * gmax,
           torch.float16: 2.0 ** -11 * gmax + 2.0 ** -24}[dtype]   # output rounding, see above
    ge = _max_err(xk.grad, gtruth)
    assert ge <= 2 * tol, f"seq-mean grad err {ge:.3g} > {2 * tol:.3g}"
    return dict(fwd_err=e, grad_err=ge)


def check_entropy(*, backend, device, dtype, T, V, temperature=1.0, seed=0):
    x, t = make_logits(T, V, dtype, device, seed=seed, special_rows=True)
    _, ent = token_logprobs(x, t, temperature=temperature, backend=backend, return_entropy=True)
    truth = token_entropy_reference(x.double(), temperature=temperature,
                                    compute_dtype=torch.float64)
    # entropy = lse - E[z]: two fp32 quantities of size |z|, so a few fp32 ulps of max |z|
    e = _max_err(ent, truth)
    assert e <= fp32_atol(finite_absmax(x) / temperature, ulps=64), f"entropy err {e}"
    assert not ent.requires_grad
    return dict(entropy_err=e)


def check_fused_linear(*, backend, device, dtype, T, H, V, temperature=1.0, chunk_size=None,
                       seed=0, pad=0):
    """pad > 0: the weight gets ``pad`` extra rows (a padded vocabulary, large values so that
    any leak into the softmax shows) and the kernel is told ``vocab_size=V``: it must equal the
    reference over the V real rows and give the padding rows exactly zero gradient."""
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, H, generator=gen)).to(dtype).to(device)
    w = (torch.randn(V, H, generator=gen) / H ** 0.5).to(dtype).to(device)
    t = torch.randint(0, V, (T,), generator=gen).to(device)
    g = torch.randn(T, generator=gen).to(device)
    w_pad = torch.cat([w, (3.0 * torch.randn(pad, H, generator=gen)).to(dtype).to(device)])
    vocab = dict(vocab_size=V) if pad else {}

    def run(fn, hh, ww, gg):
        hh, ww = hh.detach().clone().requires_grad_(), ww.detach().clone().requires_grad_()
        out = fn(hh, ww)
        out.backward(gg.to(out.dtype))
        return out.detach(), hh.grad, ww.grad

    truth = run(lambda a, b: fused_linear_token_logprobs_reference(
        a, b, t, temperature=temperature, compute_dtype=torch.float64), h.double(), w.double(),
        g.double())
    ref = run(lambda a, b: fused_linear_token_logprobs_reference(
        a, b, t, temperature=temperature, compute_dtype=dtype), h, w, g)
    ker = run(lambda a, b: fused_linear_token_logprobs(
        a, b, t, temperature=temperature, chunk_size=chunk_size, backend=backend, **vocab),
        h, w_pad, g)
    assert ker[0].dtype == torch.float32 and ker[1].dtype == dtype and ker[2].dtype == dtype
    if pad:
        assert torch.count_nonzero(ker[2][V:]) == 0, "padding rows got a gradient"
        ker = (ker[0], ker[1], ker[2][:V])
    errs = {}
    for name, k, r, tr in zip(("fwd", "grad_hidden", "grad_weight"), ker, ref, truth):
        e_k, e_r = _max_err(k, tr), _max_err(r, tr)
        mag = float(tr.abs().max())
        # low precision: the logits themselves come from a low-precision GEMM in both the
        # reference and the kernel (same rounding), so K * ref error bounds us; fp32: 64 ulps of
        # the magnitude (H-term dot products + V-term sums, both in fp32).
        atol = fp32_atol(mag, ulps=64) if dtype == torch.float32 else 2.0 ** -8 * mag
        assert e_k <= K * e_r + atol, f"{name} {dtype}: kernel err {e_k:.3g} vs ref {e_r:.3g}"
        errs[name] = (e_k, e_r)
    return errs


def check_triton_matches_torch(*, device, dtype, T, V, temperature=1.0, seed=0):
    """Triton and torch backends agree to fp32 rounding (both compute in fp32)."""
    x, t = make_logits(T, V, dtype, device, seed=seed)
    g = torch.randn(T, generator=torch.Generator().manual_seed(seed + 3)).to(device)
    outs = {}
    for be in ("torch", "triton"):
        xk = x.detach().clone().requires_grad_()
        lp, ent = token_logprobs(xk, t, temperature=temperature, backend=be, return_entropy=True)
        lp.backward(g)
        outs[be] = (lp.detach(), ent, xk.grad)
    zmax = finite_absmax(x) / temperature
    (a, ea, ga), (b, eb, gb) = outs["torch"], outs["triton"]
    assert _max_err(b, a) <= 2 * fp32_atol(zmax), _max_err(b, a)
    assert _max_err(eb, ea) <= 2 * fp32_atol(zmax, 64), _max_err(eb, ea)
    gmax = float(ga.float().abs().max())
    # grads are rounded to dtype by both: at most one ulp apart (2^-7 relative for bf16)
    tol = {torch.float32: 2 * fp32_atol(gmax), torch.bfloat16: 2.0 ** -7 * gmax,
           torch.float16: 2.0 ** -10 * gmax}[dtype]
    assert _max_err(gb, ga) <= tol, (_max_err(gb, ga), tol)


def saved_tensor_summaries(fn):
    """Run fn() (forward building an autograd graph) and return (shape, dtype) of every tensor
    autograd saved for backward, via saved_tensors_hooks."""
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved, out


# ---------------------------------------------------------------------------------------------
# Vocab-parallel worker (run under torch.multiprocessing.spawn with gloo)
# ---------------------------------------------------------------------------------------------
def tp_worker(rank: int, world: int, port: int, backend: str, dtype_name: str):
    import os
    import torch.distributed as dist
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dtype = getattr(torch, dtype_name)
        grp = dist.new_group(list(range(world)))
        T, V, H, S = 45, 2 * 97, 24, 4          # odd T, V split in two equal shards of 97
        x, t = make_logits(T, V, dtype, "cpu", seed=5)
        cu = torch.tensor([0, 7, 20, 21, T])
        g = torch.randn(T, generator=torch.Generator().manual_seed(9))
        gs = torch.randn(S, generator=torch.Generator().manual_seed(10))
        sl = slice(rank * V // world, (rank + 1) * V // world)

        def grads(fn, inputs, upstream):
            inputs = [a.detach().clone().requires_grad_() for a in inputs]
            out = fn(*inputs)
            out.backward(upstream)
            return out.detach(), [a.grad for a in inputs]

        # fp32 bound: fp32 roundings of |z| up to 1e4 (row 1) plus the per-shard combine
        zmax = finite_absmax(x) / 0.9
        tol_f = fp32_atol(zmax, ulps=32)
        full, (gfull,) = grads(lambda a: token_logprobs(a, t, temperature=0.9, backend=backend),
                               [x], g)
        shard, (gshard,) = grads(lambda a: token_logprobs(a, t, temperature=0.9, backend=backend,
                                                          tp_group=grp), [x[:, sl]], g)
        assert _max_err(shard, full) <= tol_f, ("token fwd", _max_err(shard, full))
        # the shard's grad is the same formula on the same columns; bf16 one-ulp rounding slack
        gt = float(gfull.float().abs().max()) * (2.0 ** -7 if dtype != torch.float32 else 1e-6)
        assert _max_err(gshard, gfull[:, sl]) <= gt, ("token grad", _max_err(gshard, gfull[:, sl]))

        _, ent_full = token_logprobs(x, t, return_entropy=True, backend=backend)
        _, ent_shard = token_logprobs(x[:, sl], t, return_entropy=True, backend=backend,
                                      tp_group=grp)
        assert _max_err(ent_shard, ent_full) <= fp32_atol(zmax, 64), "entropy"

        sfull, (sgfull,) = grads(lambda a: sequence_mean_logprobs(a, t, cu, backend=backend),
                                 [x], gs)
        sshard, (sgshard,) = grads(lambda a: sequence_mean_logprobs(a, t, cu, backend=backend,
                                                                    tp_group=grp), [x[:, sl]], gs)
        assert _max_err(sshard, sfull) <= tol_f, "seq fwd"
        assert _max_err(sgshard, sgfull[:, sl]) <= gt, "seq grad"

        # fused linear with the weight sharded along V, hidden replicated
        gen = torch.Generator().manual_seed(11)
        h = torch.randn(T, H, generator=gen).to(dtype)
        w = (torch.randn(V, H, generator=gen) / H ** 0.5).to(dtype)
        ffull, (fgh, fgw) = grads(lambda a, b: fused_linear_token_logprobs(
            a, b, t, chunk_size=8, backend=backend), [h, w], g)
        fshard, (sgh, sgw) = grads(lambda a, b: fused_linear_token_logprobs(
            a, b, t, chunk_size=8, backend=backend, tp_group=grp), [h, w[sl]], g)
        lowp = dtype != torch.float32
        # the per-chunk logits are identical GEMM outputs on each shard's columns; differences
        # come from the lse combine (fp32) and, for grad_hidden, the all-reduce summation order
        # of the per-shard partial products (in dtype for bf16).
        mag = float(fgh.float().abs().max())
        assert _max_err(fshard, ffull) <= fp32_atol(float(ffull.abs().max()), 64), "fused fwd"
        assert _max_err(sgh, fgh) <= (2.0 ** -6 if lowp else 1e-5) * mag, \
            ("fused grad_hidden", _max_err(sgh, fgh))
        magw = float(fgw.float().abs().max())
        assert _max_err(sgw, fgw[sl]) <= (2.0 ** -7 if lowp else 1e-5) * magw, "fused grad_weight"

        # a padded vocabulary (Megatron pads V to a multiple of TP): the last 5 ids of the last
        # shard are padding rows with large weights, vocab_size excludes them; equals the
        # unsharded kernel on the real rows only, and the padding rows get zero gradient
        real = V - 5
        tr = t.clamp(max=real - 1)
        w_pad = w.clone()
        w_pad[real:] = 3.0
        pfull, (pgh, pgw) = grads(lambda a, b: fused_linear_token_logprobs(
            a, b, tr, chunk_size=8, backend=backend), [h, w[:real]], g)
        pshard, (psgh, psgw) = grads(lambda a, b: fused_linear_token_logprobs(
            a, b, tr, chunk_size=8, backend=backend, tp_group=grp, vocab_size=real),
            [h, w_pad[sl]], g)
        assert _max_err(pshard, pfull) <= fp32_atol(float(pfull.abs().max()), 64), "padded fwd"
        assert _max_err(psgh, pgh) <= (2.0 ** -6 if lowp else 1e-5) * \
            float(pgh.float().abs().max()), ("padded grad_hidden", _max_err(psgh, pgh))
        n_real = max(0, min(real - sl.start, sl.stop - sl.start))
        assert torch.count_nonzero(psgw[n_real:]) == 0, "padding rows got a gradient"
        assert _max_err(psgw[:n_real], pgw[sl.start:sl.start + n_real]) <= \
            (2.0 ** -7 if lowp else 1e-5) * float(pgw.float().abs().max()), "padded grad_weight"
    finally:
        dist.destroy_process_group()


def tp_unequal_shards_worker(rank: int, world: int, port: int):
    """V = 7 split 4 / 3: the kernels assume equal contiguous shards (rank r holds ids
    [r * V/tp, (r + 1) * V/tp)); with validate=True every entry point must raise the same
    ValueError on every rank (no rank continuing with silently wrong log-probs)."""
    import os
    import torch.distributed as dist
    from hacpo.kernels import hacpo_loss_from_hidden, hacpo_loss_from_logits
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        grp = dist.new_group(list(range(world)))
        T, V, H = 5, 7, 4
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(T, V, generator=gen)
        h, w = torch.randn(T, H, generator=gen), torch.randn(V, H, generator=gen)
        t = torch.tensor([0, 3, 4, 6, 2])
        cu = torch.tensor([0, 2, T])
        sl = slice(0, 4) if rank == 0 else slice(4, V)
        S1 = torch.zeros(2)
        loss_args = (S1, S1, torch.tensor([True, False]), torch.ones(2))
        calls = {
            "token_logprobs": lambda: token_logprobs(x[:, sl], t, tp_group=grp),
            "sequence_mean_logprobs": lambda: sequence_mean_logprobs(x[:, sl], t, cu,
                                                                     tp_group=grp),
            "fused_linear": lambda: fused_linear_token_logprobs(h, w[sl], t, tp_group=grp),
            "loss_from_logits": lambda: hacpo_loss_from_logits(
                x[:, sl], t, cu, *loss_args, minibatch_index=0, tp_group=grp),
            "loss_from_hidden": lambda: hacpo_loss_from_hidden(
                h, w[sl], t, cu, *loss_args, minibatch_index=0, tp_group=grp),
        }
        for name, call in calls.items():
            try:
                call()
            except ValueError as e:
                assert "vocab shards are 3 to 4 columns wide" in str(e), (name, rank, str(e))
            else:
                raise AssertionError(f"{name} on rank {rank}: unequal shards not detected")
    finally:
        dist.destroy_process_group()


def check_fused_linear_under_autocast(backend, T=48, H=32, V=300, scale=4.0, seed=0,
                                      device="cpu"):
    """fp32 hidden/weight under autocast to bf16 (on ``device``): the forward's chunk logits are
    the bf16 GEMM L = bf16(h) @ bf16(w).T (what the model's lm_head would give), and the grads must be the
    exact gradients of that forward: dL = g * (onehot - softmax(L)), grad_h = dL @ w,
    grad_w = dL.T @ h. A backward that recomputes L in fp32 against the forward's bf16 lse gets
    a softmax that does not sum to 1 (relative error ~ |L| * 2^-9, here ~1e-2)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=gen).to(device)
    w = (torch.randn(V, H, generator=gen) * scale / H ** 0.5).to(device)   # |L| up to ~20
    t = torch.randint(0, V, (T,), generator=gen).to(device)
    g = torch.randn(T, generator=gen).to(device)
    hk, wk = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        lp = fused_linear_token_logprobs(hk, wk, t, chunk_size=16, backend=backend)
    lp.backward(g)
    assert hk.grad.dtype == torch.float32 and wk.grad.dtype == torch.float32
    L = (h.bfloat16() @ w.bfloat16().t()).double()
    dL = g.double()[:, None] * (torch.nn.functional.one_hot(t, V).double() - torch.softmax(L, -1))
    truth = (torch.log_softmax(L, -1).gather(1, t[:, None]).squeeze(1), dL @ w.double(),
             dL.t() @ h.double())
    for name, k, tr in zip(("fwd", "grad_hidden", "grad_weight"), (lp, hk.grad, wk.grad), truth):
        # fp32 math on the same bf16 logits: a few fp32 ulps (64) of the magnitude
        assert _max_err(k, tr) <= fp32_atol(float(tr.abs().max()), ulps=64), \
            (name, _max_err(k, tr), float(tr.abs().max()))
    return {"fwd_err": _max_err(lp, truth[0]), "grad_hidden_err": _max_err(hk.grad, truth[1])}
