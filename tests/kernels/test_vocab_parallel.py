"""Vocab-parallel (V sharded over a tp group): same values and grads as unsharded."""
import socket

import pytest
import torch
import torch.multiprocessing as mp

from hacpo.kernels.logprobs import combine_stats, finish, local_stats_torch, token_logprobs
from tests.kernels import _checks as C


@pytest.mark.parametrize("splits", [[781], [400, 381], [1, 500, 280]])
def test_shard_combine_math_without_communication(splits):
    """The combine the all-reduces implement, on unequal shards incl. a 1-column shard and the
    all -inf row (whose -inf shards must not poison the sum)."""
    x, t = C.make_logits(64, sum(splits), torch.float32, "cpu")
    parts, start = [], 0
    for n in splits:
        parts.append(local_stats_torch(x[:, start:start + n], t - start, 1 / 0.9, True))
        start += n
    m, ls, tgt, ez = combine_stats(*(torch.stack(p) for p in zip(*parts)))
    logp, ent = finish(m, ls, tgt, ez)
    full, fent = token_logprobs(x, t, temperature=0.9, return_entropy=True)
    zmax = C.finite_absmax(x) / 0.9      # finite: row 0 is -inf outside its target
    # fp32 roundings of the per-shard lse and the combine: a few ulps of max |z|
    assert C._max_err(logp, full) <= C.fp32_atol(zmax, 32)
    assert C._max_err(ent, fent) <= C.fp32_atol(zmax, 64)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vocab_parallel_two_gloo_ranks(dtype):
    # token_logprobs, entropy, sequence_mean_logprobs and fused_linear (weight sharded), each
    # checked inside the workers against the unsharded result (see _checks.tp_worker)
    mp.spawn(C.tp_worker, args=(2, _free_port(), "torch", dtype), nprocs=2, join=True)


@pytest.mark.multiprocess
@pytest.mark.triton_interpret
def test_vocab_parallel_two_gloo_ranks_triton(triton_device):
    if triton_device != "cpu":
        pytest.skip("gloo all-reduce of CUDA tensors is not what this test checks; CPU only")
    # the spawned workers inherit TRITON_INTERPRET=1 from this process (set in conftest)
    mp.spawn(C.tp_worker, args=(2, _free_port(), "triton", "bfloat16"), nprocs=2, join=True)


@pytest.mark.multiprocess
def test_unequal_vocab_shards_are_an_error_on_every_rank():
    # shards of 4 and 3 columns: rank 1's ids would be read as 3.. instead of 4.., giving wrong
    # log-probs on rank 0 and a misleading "target out of range" on rank 1 (see the worker)
    mp.spawn(C.tp_unequal_shards_worker, args=(2, _free_port()), nprocs=2, join=True)
