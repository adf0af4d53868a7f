"""Worker for the gloo rank-invariance test (module-level so torch.multiprocessing can spawn it)."""
import os

import torch
import torch.distributed as dist

from hacpo.engine import hacpo_policy_loss, grpo_policy_loss


def make_problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    N, F, T = 32, 6, 5
    feats = torch.randn(N, F, generator=g, dtype=torch.float64)
    weight = torch.randn(F, generator=g, dtype=torch.float64) * 0.05
    old = torch.randn(N, generator=g, dtype=torch.float64) * 0.05
    A = torch.randn(N, generator=g, dtype=torch.float64)
    is_self = torch.rand(N, generator=g) < 0.5
    omega = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    tok_feats = torch.randn(N, T, F, generator=g, dtype=torch.float64)
    mask = torch.rand(N, T, generator=g) < 0.7
    mask[:, 0] = True
    return feats, weight, old, A, is_self, omega, tok_feats, mask


def losses(weight, sl, divisor_seq, divisor_tok, seed=0):
    """The minibatch's HACPO and GRPO losses on samples ``sl`` with explicit divisors; the
    'policy' is a linear scorer w (new log-prob = feats @ w)."""
    feats, _, old, A, is_self, omega, tok_feats, mask = make_problem(seed)
    new = feats[sl] @ weight
    lh, _ = hacpo_policy_loss(new, old[sl], A[sl], is_self[sl], omega[sl], minibatch_index=1,
                              divisor=divisor_seq)
    tok = tok_feats[sl] @ weight
    lg, _ = grpo_policy_loss(tok, tok.detach() + 0.1, mask[sl], A[sl], divisor=divisor_tok)
    return lh, lg


def worker(rank: int, world: int, port: int, out_path: str):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _, w0, *_rest, mask = make_problem()
        N = mask.shape[0]
        half = N // world
        sl = slice(rank * half, (rank + 1) * half)
        results = {}
        for name, idx in (("hacpo", 0), ("grpo", 1)):
            w = w0.clone().requires_grad_()
            loss = losses(w, sl, divisor_seq=N, divisor_tok=int(mask.sum()))[idx]
            loss.backward()
            stacked = torch.cat([loss.detach().reshape(1), w.grad])
            dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
            results[name] = stacked
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()
