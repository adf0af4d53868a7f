"""One ``MegatronRank.update`` (the megatron trainer's learner update, without Ray: a 1-rank
gloo world in a spawned process) against ``update_learner`` with torch's AdamW on the same HF
policy, view, minibatches and old log-probs (hacpo, 2 minibatches, weight decay and an active
``grad_clip``):

- fp32 weights: the same losses, grad norms and weights;
- fp16 weights: the losses and grad norms of the fp32 update within fp16 rounding. The trainer
  takes no loss scale for fp16 (as the torch trainer's AdamW): megatron's dynamic loss scaler
  (2^32 at first) would skip the first updates on overflow, each counted as non-finite, and
  with the loss left unscaled every gradient was 1/2^32 of its value (no update at all).

The CUDA calls megatron-core makes are patched in ``tests/megatron/_cpu_megatron.py``.
"""
import dataclasses
import os

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

from hacpo.engine.config import AlgorithmConfig  # noqa: E402
from hacpo.engine.pool import LearnerView  # noqa: E402
from hacpo.engine.run_config import ParallelConfig  # noqa: E402
from hacpo.engine.update import update_learner  # noqa: E402
from hacpo.models.policy import PolicyConfig, build_policy  # noqa: E402

HF = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2}
OPTIM = {"lr": 1e-2, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.99, "grad_clip": 0.05}
MINIBATCHES = [[0, 1, 2, 3, 6], [4, 5, 7, 8, 9]]
ALGO = AlgorithmConfig(name="hacpo", num_minibatches=2)


def _policy():
    return build_policy(PolicyConfig(name="a", kind="hf", arch="llama", tokenizer="char",
                                     hf_config=HF, seed=0))


def _inputs(pol):
    """10 samples of 3 prompts (self and cross rows), random advantages and omegas, and old
    log-probs off the policy's own (ratios away from 1: the clips act)."""
    V, g = pol.tokenizer.vocab_size, torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, V, (3 + p,), generator=torch.Generator().manual_seed(100 + p))
               .tolist() for p in ((i // 2) % 3 for i in range(10))]
    resps = [torch.randint(4, V, (int(torch.randint(2, 8, (1,), generator=g)),),
                           generator=g).tolist() for _ in range(10)]
    view = LearnerView(idx=torch.arange(10), advantages=torch.randn(10, generator=g),
                       omega=torch.rand(10, generator=g) + 0.5,
                       is_self=torch.tensor([i % 3 != 2 for i in range(10)]),
                       prompt_ids=prompts, response_ids=resps, dropped={})
    with torch.no_grad():
        tl, mask = pol.response_logprobs(prompts, resps)
    tl = tl + 0.3 * torch.randn(tl.shape, generator=torch.Generator().manual_seed(5)) * mask
    toks = [tl[i, :len(r)].clone() for i, r in enumerate(resps)]
    return view, torch.stack([t.mean() for t in toks]), toks


def one_rank(port: int, pol, dtype: torch.dtype):
    """A set-up 1-rank MegatronRank (default layout, OPTIM) holding ``pol``'s weights in
    ``dtype`` (call inside cpu_patches, in a spawned process)."""
    import torch.distributed as dist

    from hacpo.launch.megatron_trainer import MegatronRank
    from hacpo.models.megatron import ArchSpec, hf_to_megatron

    r = MegatronRank("a", 0, 1, 1, "")
    r._store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    shard = hf_to_megatron(pol.model.state_dict(), ArchSpec.from_hf(pol.model.config))
    par = ParallelConfig()
    r.setup(("127.0.0.1", port), pol.model.config, dtype,
            {k: v.to(dtype) for k, v in shard.items()},
            {**dataclasses.asdict(par), "recompute_kw": par.recompute_kwargs()}, OPTIM, 0, 60.0)
    return r


def _rank_worker(rank, world, port, dtype, out):
    from tests.megatron._cpu_megatron import cpu_patches

    torch.set_num_threads(1)
    with cpu_patches():
        pol = _policy()
        view, lp_old, toks = _inputs(pol)
        r = one_rank(port, pol, dtype)
        res = r.update({"algo": ALGO, "view": view, "lp_old": lp_old, "kl_coef": 0.0,
                        "ref_token_logp": {}, "old_token_logp": [],
                        "minibatches": MINIBATCHES, "micro_batch": 2, "micro_batch_tokens": 0,
                        "temperature": 1.0, "streak": 0, "max_nonfinite": 3})
        torch.save({"minibatches": [{k: m[k] for k in ("finite", "loss", "grad_norm")}
                                    for m in res["minibatches"]],
                    "weights": {k: v.float() for k, v in r.hf_weights().items()}}, out)
        r.close()


def _megatron(tmp_path, dtype):
    from tests.megatron._cpu_megatron import free_port

    out = str(tmp_path / f"{dtype}.pt")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    mp.spawn(_rank_worker, args=(1, free_port(), dtype, out), nprocs=1, join=True)
    return torch.load(out)


@pytest.fixture(scope="module")
def reference():
    pol = _policy()
    view, lp_old, toks = _inputs(pol)
    before = {k: v.clone() for k, v in pol.model.state_dict().items()}
    opt = torch.optim.AdamW(pol.parameters(), lr=OPTIM["lr"], weight_decay=OPTIM["weight_decay"],
                            betas=(OPTIM["beta1"], OPTIM["beta2"]))
    trace = []
    update_learner(ALGO, pol, opt, view, lp_old=lp_old, old_token_logp=toks,
                   prompt_of_sample=None, generator=None, micro_batch=2,
                   grad_clip=OPTIM["grad_clip"], nonfinite={"streak": 0, "total": 0},
                   max_nonfinite=3, minibatches=MINIBATCHES, trace=trace)
    assert all(t["finite"] for t in trace)
    # the clip acts in both updates, the weight decay on every weight (norms included)
    assert all(t["grad_norm"] > 4 * OPTIM["grad_clip"] for t in trace), trace
    return trace, before, pol.model.state_dict()


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_rank_update_equals_update_learner(reference, tmp_path, dtype):
    trace, before, after = reference
    got = _megatron(tmp_path, dtype)
    # fp32: the same sums in another order (seen 1e-7 relative); fp16: its forward and backward
    # (seen 3e-4 relative)
    rel = 1e-5 if dtype == torch.float32 else 3e-3
    assert [m["finite"] for m in got["minibatches"]] == [True, True], got["minibatches"]
    for m, t in zip(got["minibatches"], trace):
        assert m["loss"] == pytest.approx(t["loss"], rel=rel), (m, t)
        assert m["grad_norm"] == pytest.approx(t["grad_norm"], rel=rel), (m, t)
    if dtype == torch.float32:
        w = got["weights"]
        assert w.keys() == after.keys() - {"lm_head.weight"}     # tied: the embedding
        # 2 AdamW steps of lr 1e-2 (seen 5e-6: Adam's first step, ~lr * sign(g), amplifies
        # rounding where |g| is ~eps)
        for k in w:
            assert (after[k] - before[k]).abs().max() > 1e-3, f"{k} did not move"
            torch.testing.assert_close(w[k], after[k], atol=2e-5, rtol=0, msg=k)
