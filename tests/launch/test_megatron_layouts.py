"""Combined layouts inside ``hacpo train``: a TP=2 x PP=2 megatron agent (4 rank actors; the
vocab-parallel log-probs on the last stage of a 1F1B pipeline) next to a PP=2 x DP=2 one (4 rank
actors; two pipelines, each training its share of every minibatch), 8 ranks in all, on the
private Ray cluster the run starts itself (sized to the ranks; gone when the run ends), as a
user's ``hacpo train`` does. One step's metrics and weights equal the torch trainer's
(in-process, trainer_backend=local), with activation recomputation on both and megatron's
distributed optimizer on the DP=2 one; resumed for a second step in other layouts (TP=2 x DP=2
and DP=4, both with the distributed optimizer: the optimizer state moves from the plain
optimizer and from the other layout's slices) they equal the torch trainer's two.
tests/launch/test_megatron_trainer.py covers TP, PP and DP one at a time; tests/megatron the
same combinations at the policy level.
"""
import logging

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

import ray  # noqa: E402

from hacpo.engine import checkpoint as ckpt  # noqa: E402
from hacpo.engine.run_config import ParallelConfig  # noqa: E402
from hacpo.engine.trainer import train  # noqa: E402

from .test_megatron_trainer import (_check_metrics, _check_weights, _initial_weights,  # noqa: E402
                                    _rows, _weights, megatron_cfg)

# with activation recomputation (megatron's; the same gradients): the attention core and MLP
# of every layer at TP=2 x PP=2, every layer whole at PP=2 x DP=2, whose two pipelines also
# use megatron's distributed optimizer (each DP rank steps and checkpoints its slice)
AGENTS = (("llama-tp2pp2", "llama3.2",
           ParallelConfig(tp=2, pp=2, weight_bucket_mb=0.08, recompute="selective",
                          recompute_modules="core_attn,mlp")),
          ("char-pp2dp2", "char", ParallelConfig(pp=2, dp=2, recompute="full",
                                                 distributed_optimizer=True)))
NAMES = [a[0] for a in AGENTS]


def test_tp2pp2_and_pp2dp2_one_step_and_resume_equal_torch_trainer(tmp_path, caplog):
    assert not ray.is_initialized()            # the run starts (and stops) its own cluster
    train(megatron_cfg(tmp_path, "torch", "torch", AGENTS), echo=lambda *_: None)
    with caplog.at_level(logging.INFO, logger="hacpo"):
        summary = train(megatron_cfg(tmp_path, "meg", "megatron", AGENTS),
                        echo=lambda *_: None)
    assert not ray.is_initialized()
    # what the ranks built (their models' configs and optimizers), as the driver logged it
    built = [r.getMessage() for r in caplog.records if "megatron trainer groups" in r.message]
    assert len(built) == 1 and (
        "llama-tp2pp2 tp2 pp2 dp1 (transformer_impl=local sequence_parallel=False "
        "recompute=selective:core_attn,mlp optimizer=FP32Optimizer), char-pp2dp2 tp1 pp2 dp2 "
        "(transformer_impl=local sequence_parallel=False recompute=full:1 "
        "optimizer=DistributedOptimizer)") in built[0], built
    meg, ref = _rows(tmp_path, "meg"), _rows(tmp_path, "torch")
    assert [r["step"] for r in meg] == [0] and summary["agents"] == NAMES
    _check_metrics(meg[0], ref[0], NAMES)
    assert meg[0]["train/llama-tp2pp2/trained_cross"] > 0      # cross samples trained too
    for name in NAMES:
        for stage in ("score_self", "backward_self", "optimizer", "old_logprobs"):
            assert meg[0][f"time/{stage}/{name}"] > 0, (stage, name)
    before = _initial_weights(tmp_path, AGENTS)
    _check_weights(_weights(tmp_path, "meg"), _weights(tmp_path, "torch"), before, NAMES)
    # the second step from the checkpoint, in other layouts of the same 4 ranks: the driver
    # gathers the optimizer state by parameter name (the PP=2 x DP=2 slices joined) and every
    # new rank takes its slice; equal to two uninterrupted torch steps
    layouts = {a["name"]: a["megatron"]
               for a in ckpt.load(tmp_path / "meg" / "checkpoint.pt")["agents"]}
    assert [layouts[n]["distributed_optimizer"] for n in NAMES] == [False, True]
    train(megatron_cfg(tmp_path, "torch2", "torch", AGENTS, steps=2), echo=lambda *_: None)
    train(megatron_cfg(tmp_path, "meg", "megatron", AGENTS, steps=2).override(
        {"agents.0.parallel.pp": 1, "agents.0.parallel.dp": 2,
         "agents.0.parallel.distributed_optimizer": True,
         "agents.1.parallel.pp": 1, "agents.1.parallel.dp": 4}), resume=True,
        echo=lambda *_: None)
    layouts = {a["name"]: a["megatron"]
               for a in ckpt.load(tmp_path / "meg" / "checkpoint.pt")["agents"]}
    assert [(layouts[n]["tp"], layouts[n]["pp"], layouts[n]["dp"],
             layouts[n]["distributed_optimizer"]) for n in NAMES] == [(2, 1, 2, True),
                                                                      (1, 1, 4, True)]
    meg, ref = _rows(tmp_path, "meg"), _rows(tmp_path, "torch2")
    assert [r["step"] for r in meg] == [0, 1]
    for a, b in zip(meg, ref):
        _check_metrics(a, b, NAMES)
    _check_weights(_weights(tmp_path, "meg"), _weights(tmp_path, "torch2"), before, NAMES)



# parallel.micro_batch_tokens at PP=2 x DP=2 (token-balanced DP shares; micro-batches of 2 rows
# and of 1 row through the 1F1B schedule: 3 prompts x G=2 = 6 own rows of ~45 tokens, 3 per DP
# rank, a budget of 100 tokens) next to TP=2 with sequence parallelism (rows of ~100
# characters, each rounded up to an even length, 210 tokens: 2 rows each); both also score
# their old log-probs by the budget. Every row is shorter than its budget, so every micro-batch
# holds at most its budget of padded tokens.
BUDGETS = {"llama-pp2dp2-tok": 100, "char-tp2sp-tok": 210}
BUDGET_AGENTS = (("llama-pp2dp2-tok", "llama3.2",
                  ParallelConfig(pp=2, dp=2, micro_batch_tokens=BUDGETS["llama-pp2dp2-tok"])),
                 ("char-tp2sp-tok", "char",
                  ParallelConfig(tp=2, micro_batch_tokens=BUDGETS["char-tp2sp-tok"],
                                 sequence_parallel=True)))


def test_token_budget_micro_batches_equal_torch_trainer(tmp_path, caplog):
    """One step with ``parallel.micro_batch_tokens`` (hacpo/engine/batching.py) equals the
    torch trainer's: the budget changes how rows are cut, not the loss or its gradient; so
    does sequence parallelism (the TP=2 agent), which lays activations out differently and
    pads each micro-batch to an even length."""
    names = [a[0] for a in BUDGET_AGENTS]
    over = {"prompts_per_step": 3, "algorithm.num_minibatches": 1}
    train(megatron_cfg(tmp_path, "torch", "torch", BUDGET_AGENTS, **over), echo=lambda *_: None)
    with caplog.at_level(logging.INFO, logger="hacpo"):
        train(megatron_cfg(tmp_path, "meg", "megatron", BUDGET_AGENTS, **over),
              echo=lambda *_: None)
    assert "char-tp2sp-tok tp2 pp1 dp1 (transformer_impl=local sequence_parallel=True " \
           "recompute=none optimizer=FP32Optimizer)" in caplog.text    # what the ranks built
    meg, ref = _rows(tmp_path, "meg"), _rows(tmp_path, "torch")
    _check_metrics(meg[0], ref[0], names)
    for name in names:
        n, padded = meg[0][f"batch/micro_batches/{name}"], meg[0][f"tokens/update_padded/{name}"]
        real = meg[0][f"tokens/forward_self/{name}"] + meg[0][f"tokens/forward_cross/{name}"]
        # budget packing: several micro-batches, none over its budget, padding included
        assert n >= 3 and padded >= real and padded <= n * BUDGETS[name], (name, n, padded)
    # under sequence parallelism every forwarded micro-batch is a whole number of TP slices
    sp = meg[0]["tokens/update_padded/char-tp2sp-tok"]
    assert sp % 2 == 0 and sp > meg[0]["tokens/forward_self/char-tp2sp-tok"], sp
    _check_weights(_weights(tmp_path, "meg"), _weights(tmp_path, "torch"),
                   _initial_weights(tmp_path, BUDGET_AGENTS), names)
