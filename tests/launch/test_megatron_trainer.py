"""megatron-core trainer groups inside ``hacpo train`` (agents.N.trainer=megatron,
trainer_backend=ray) against a real local Ray cluster (the module's 4 logical CPUs): two HF Llama
agents, one at TP=2 (2 rank actors, Llama 3.2 BPE, 562 ids) and one at PP=2 (2 rank actors,
megatron's 1F1B schedule, the character tokenizer), each rank a Ray actor in its agent's placement
group, the ranks of a group a gloo world of their own.

- one step equals the same config trained in-process by the torch trainer (metrics and weights);
- a resumed second step (fresh rank actors, weights and per-rank optimizer state from the
  checkpoint; each rank wrote and reads its own optimizer shard file) equals the torch
  trainer's uninterrupted two steps;
- bad configurations are clear errors, and so is a killed rank actor.

The CUDA calls megatron-core makes are patched to CPU in every rank process through
``trainer_setup_hook`` (tests/launch/_megatron_cpu.py: the test-only patches).
"""
import dataclasses
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

from hacpo.engine import checkpoint as ckpt  # noqa: E402
from hacpo.engine.rewards import register_reward  # noqa: E402
from hacpo.engine.run_config import ParallelConfig, load_config  # noqa: E402
from hacpo.engine.trainer import train  # noqa: E402
from hacpo.launch import megatron_trainer  # noqa: E402

from ._launch_helpers import (capture_instances, free_cpus_back, run_in_thread,  # noqa: E402
                              wait_for_first_step)
from ._megatron_cpu import HOOK  # noqa: E402

import ray  # noqa: E402

# hidden 32 = 4 heads x 8 (2 kv heads), FFN 64, 2 layers: splits at TP=2 and at PP=2
HF = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2}
# llama-tp2 streams its weights to the driver in 2 buckets of <= 0.08 MiB (84 KB): the
# embedding (562 x 32 fp32, 72 KB), then both layers (37 KB each) and the final norm (tied
# embeddings: no output layer of its own)
AGENTS = (("llama-tp2", "llama3.2", ParallelConfig(tp=2, weight_bucket_mb=0.08)),
          ("char-pp2", "char", ParallelConfig(pp=2)))
NAMES = [a[0] for a in AGENTS]


@register_reward("megatron_test_length", in_process=True)
def length_reward(response: str, gold: str) -> float:
    """Untrained tiny policies almost never answer right: a reward that varies with the
    response length gives every group non-zero advantages, so the updates move the weights."""
    return (len(response) % 5) / 4.0


def megatron_cfg(tmp, name: str, trainer: str, agents=AGENTS, **over):
    """The tiny3 preset with two tiny HF Llama agents (``agents``: name, tokenizer, layout);
    ``trainer="torch"`` is the in-process reference (trainer_backend=local), ``"megatron"``
    the rank groups (an agent whose layout is None then trains with trainer=torch in a Ray
    trainer actor)."""
    base = {"out_dir": str(tmp / name), "cache_dir": str(tmp / "cache"), "threads": 1,
            "plots": False, "tensorboard": False, "steps": 1, "prompts_per_step": 2,
            "data.eval_size": 4, "rollout.max_new_tokens": 8,
            "reward.name": "megatron_test_length",
            # tiny3's warm-up leaves the agents nearly random: their reduced vocabularies cannot
            # spell each other's text, so with the default nearly every cross sample is dropped
            "drop_unencodable": False}
    cfg = load_config("tiny3", overrides={**base, **over})
    out = []
    for (aname, tok, par), a in zip(agents, cfg.agents):
        pol = dataclasses.replace(a.policy, name=aname, kind="hf", arch="llama", hf_config=HF,
                                  tokenizer=tok, reduce_vocab=tok != "char")
        meg = trainer == "megatron" and par is not None
        out.append(dataclasses.replace(a, policy=pol, trainer="megatron" if meg else "torch",
                                       parallel=par if meg else ParallelConfig()))
    return dataclasses.replace(
        cfg, agents=out, trainer_backend="ray" if trainer == "megatron" else "local",
        trainer_setup_hook=HOOK if trainer == "megatron" else "")


def _rows(tmp, name):
    return [json.loads(line) for line in open(tmp / name / "metrics.jsonl")]


def _weights(tmp, name):
    return {a["name"]: a["model"] for a in ckpt.load(tmp / name / "checkpoint.pt")["agents"]}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("megatron")


@pytest.fixture(scope="module")
def torch_runs(tmp):
    """The in-process torch trainer's reference: 1 step and 2 steps."""
    quiet = dict(echo=lambda *_: None)
    one = train(megatron_cfg(tmp, "torch1", "torch"), **quiet)
    two = train(megatron_cfg(tmp, "torch2", "torch", steps=2), **quiet)
    return one, two


@pytest.fixture(scope="module")
def megatron_step1(cluster, tmp, torch_runs):
    with pytest.MonkeyPatch.context() as mp:
        groups = capture_instances(mp, megatron_trainer.MegatronAgents)
        spans.clear()
        real = megatron_trainer.MegatronAgents._update_result

        def result(self, k, view, pool, mbs, results, *a, **kw):
            spans.append((k, [r["span"] for r in results], time.time()))
            return real(self, k, view, pool, mbs, results, *a, **kw)
        mp.setattr(megatron_trainer.MegatronAgents, "_update_result", result)
        summary = train(megatron_cfg(tmp, "meg", "megatron"), echo=lambda *_: None)
    free_cpus_back()
    return summary, groups[0].weight_buckets


# megatron_step1: (agent, its ranks' update spans, when the driver took the results), in the
# order taken (wall clock of this machine: the ranks' and the driver's)
spans: list = []


def test_agents_update_at_once(megatron_step1):
    """The two megatron agents' ranks get their update requests before either's results are
    awaited (MegatronAgents.update_all): every rank of both agents had started its update
    before the driver took agent 0's results (one agent after another, agent 1's ranks start
    only after that); the results are taken in agent order (test_one_step_equals_torch_trainer:
    the same updates as one agent after another)."""
    assert [k for k, _, _ in spans] == [0, 1]
    (_, a, taken0), (_, b, _) = spans
    assert len(a) == len(b) == 2                       # TP=2 and PP=2: two ranks each
    assert max(s for s, _ in a + b) < taken0, spans


# The two trainers see the same rollouts and advantages; they differ only in float rounding
# (megatron's fused QKV / vocab-parallel log-softmax vs HF's ops, ~1e-6 in a log-prob), which
# the 4 AdamW minibatch steps (lr 1e-3) of a step carry into the weights. Seen: weights <= 2.4e-6
# apart (GRPO at DP=2; 5e-7 elsewhere), metrics <= 1e-5 relative. Deliberate bugs tried: the
# loss divided by a micro-batch's row count, or by the minibatch's divisor times dp, instead of
# the minibatch's divisor: the loss metric is off by a factor ~2 and the checks fail; no
# gradient clipping (grad norms ~1.5 > grad_clip 1): the metrics pass, the weights fail. Each
# step moves weights by up to ~lr = 1e-3 (checked), 50x the weight tolerance.
W_ATOL = 2e-5
M_RTOL, M_ATOL = 1e-4, 1e-6


def _check_metrics(meg: dict, ref: dict, names=NAMES) -> int:
    keys = [k for k in ref if k.startswith("train/")]
    assert keys and set(keys) == {k for k in meg if k.startswith("train/")}
    for k in keys:
        assert meg[k] == pytest.approx(ref[k], rel=M_RTOL, abs=M_ATOL), k
    moved = [n for n in names if abs(ref[f"train/{n}/loss"]) > 1e-4
             and ref[f"train/{n}/grad_norm"] > 1e-3]
    assert moved == list(names), "the check needs non-zero losses and gradients for every agent"
    return len(keys)


def _check_weights(meg: dict, ref: dict, before: dict, names=NAMES) -> None:
    for name in names:
        a, b, w0 = meg[name], ref[name], before[name]
        assert a.keys() == b.keys()
        biggest = max((b[k] - w0[k]).abs().max().item() for k in b)
        assert biggest > 5e-4, f"{name}: the torch step did not move the weights"
        for k in b:
            torch.testing.assert_close(a[k], b[k], atol=W_ATOL, rtol=0, msg=f"{name} {k}")


def test_one_step_equals_torch_trainer(tmp, torch_runs, megatron_step1):
    """After one HACPO step (M=4 minibatches, self + cross samples) the megatron groups'
    metrics and pulled HF weights (llama-tp2's streamed in 2 buckets) equal the in-process
    torch trainer's."""
    meg, ref = _rows(tmp, "meg"), _rows(tmp, "torch1")
    assert [r["step"] for r in meg] == [0]
    _check_metrics(meg[0], ref[0])
    for name in NAMES:
        for stage in ("score_self", "backward_self", "optimizer", "old_logprobs"):
            assert meg[0][f"time/{stage}/{name}"] > 0, (stage, name)
    for name in NAMES:                                      # cross samples trained too
        assert meg[0][f"train/{name}/trained_cross"] > 0, name
    _check_weights(_weights(tmp, "meg"), _weights(tmp, "torch1"), _initial_weights(tmp))
    summary, buckets = megatron_step1
    assert buckets == [2, 1]
    assert summary["before"] == torch_runs[0]["before"]


def _warm_policies(tmp, agents=AGENTS):
    """The agents' policies before RL (the warm start both runs share)."""
    from hacpo.engine import build
    cfg = megatron_cfg(tmp, "torch1", "torch", agents)
    data = build.load_data(cfg)
    pols = build.build_policies(cfg, data)
    build.warm_start(cfg, data, pols, echo=lambda *_: None)
    return pols


def _initial_weights(tmp, agents=AGENTS):
    """The agents' weights before RL (the warm start both runs share)."""
    return {p.name: p.state_dict() for p in _warm_policies(tmp, agents)}


def _shard_dirs(tmp, name):
    """{agent: [its optimizer-shard directories]} of a run, and the files its checkpoint
    names (relative to the run's out_dir) per agent."""
    root = tmp / name / "checkpoint-megatron"
    dirs = {a: sorted(p.name for p in (root / a).iterdir()) for a in NAMES}
    named = {a["name"]: a["megatron"]["optim_files"]
             for a in ckpt.load(tmp / name / "checkpoint.pt")["agents"]}
    return dirs, named


def test_ranks_write_their_optimizer_shards(tmp, megatron_step1):
    """The checkpoint holds no optimizer state: it names one file per rank, which that rank
    wrote under out_dir/checkpoint-megatron/<agent>/<save id>/, the only save directory left."""
    state = ckpt.load(tmp / "meg" / "checkpoint.pt")
    dirs, named = _shard_dirs(tmp, "meg")
    for a in state["agents"]:
        meg = a["megatron"]
        assert "optim" not in meg
        assert len(dirs[a["name"]]) == 1
        assert named[a["name"]] == [f"checkpoint-megatron/{a['name']}/{dirs[a['name']][0]}/"
                                    f"rank-{i}.pt" for i in range(2)]
        # with the size each rank wrote (checked on resume)
        assert meg["optim_bytes"] == [(tmp / "meg" / f).stat().st_size for f in named[a["name"]]]
        for f in named[a["name"]]:
            sd = ckpt.load(tmp / "meg" / f)
            assert sd["plain"]["state"], f"{f}: no optimizer state (Adam moments after a step)"
            # every parameter's state by its megatron name (what moves to another layout)
            assert [len(g) for g in sd["params"][0]] == [
                len(g["params"]) for g in sd["plain"]["param_groups"]]
            assert all(e["name"] and e["range"] is None and not e["main"]
                       for g in sd["params"][0] for e in g)


def test_each_rank_is_sent_its_own_shard_only(cluster):
    """What the driver ships to a group's ranks (the start-up weights, a resume's weights,
    moved optimizer state and KL reference) is cut per (tp, pp) shard and put in the object
    store once per shard: a rank (and its node) fetches its shard, never the whole model; the
    DP replicas of a shard share one object."""
    calls = []

    def cut(tp_rank, pp_rank):
        calls.append((tp_rank, pp_rank))
        return {"shard": torch.tensor([tp_rank, pp_rank])}

    refs = megatron_trainer.shard_refs(cut, 2, 2, 2)          # tp=2, pp=2, dp=2: 8 ranks
    assert sorted(calls) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # each shard cut once
    for i, ref in enumerate(refs):
        tp_rank, pp_rank, dp_rank = megatron_trainer.rank_coords(i, 2, 2)
        assert ray.get(ref)["shard"].tolist() == [tp_rank, pp_rank]
        assert ref.hex() == refs[tp_rank + 2 * 2 * pp_rank].hex()    # DP rank 0's object
    assert len({r.hex() for r in refs}) == 4


def test_named_shards_are_checked_on_resume(tmp_path):
    """Resuming checks the shard files a checkpoint names: one per rank, each present with the
    size its rank wrote (a checkpoint from before sizes were recorded: present)."""
    (tmp_path / "d").mkdir()
    for i in range(2):
        (tmp_path / "d" / f"rank-{i}.pt").write_bytes(b"x" * 10)
    ok = [{"path": "d/rank-0.pt", "bytes": 10}, {"path": "d/rank-1.pt", "bytes": None}]
    assert megatron_trainer.check_named_shards(ok, str(tmp_path), 2, "a", "optimizer") == \
        [str(tmp_path / "d" / f"rank-{i}.pt") for i in range(2)]
    with pytest.raises(ValueError, match=r"agent 'a': the checkpoint names 2 optimizer shards "
                                         r"for 4 ranks"):
        megatron_trainer.check_named_shards(ok, str(tmp_path), 4, "a", "optimizer")
    bad = [{"path": "d/rank-0.pt", "bytes": 11}, {"path": "d/rank-2.pt", "bytes": None}]
    with pytest.raises(ValueError, match=r"agent 'a': the checkpoint's KL reference shards are "
                                         r"missing or changed: d/rank-0\.pt \(10 bytes, written "
                                         r"with 11\), d/rank-2\.pt \(missing\); keep "
                                         r"checkpoint-megatron/ next to checkpoint\.pt"):
        megatron_trainer.check_named_shards(bad, str(tmp_path), 2, "a", "KL reference")


def test_optimizer_state_that_cannot_move_is_clear_error(tmp_path):
    """A resume in another layout reads the ranks' shards by megatron name: the rank order it
    assumes; shards that name no parameters (written before they did: the distributed
    optimizer's, fp16 / bf16 weights', a bare state dict), a state that is not Adam's, shards
    at different steps or missing a parameter, main weights for some parameters only, the
    distributed optimizer's slices that do not cover a parameter once, and a change of the
    layout other than tp / pp / dp / distributed optimizer: each a clear error. Shards
    without any state (no update ran yet) move as nothing (a fresh optimizer)."""
    from types import SimpleNamespace

    from hacpo.models.megatron import ArchSpec
    from hacpo.models.megatron.convert import moments_to_hf
    from hacpo.models.megatron.policy import join_slices
    from tests.megatron._workers import tiny_hf

    # megatron's order: TP fastest, then DP, then PP (tp=2, dp=2, pp=2)
    assert [megatron_trainer.rank_coords(i, 2, 2) for i in range(8)] == [
        (0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1), (0, 1, 0), (1, 1, 0), (0, 1, 1), (1, 1, 1)]
    arch = ArchSpec.from_hf(tiny_hf("llama").config)
    old = {"tp": 1, "pp": 1, "dp": 1, "transformer_impl": "local"}
    path = str(tmp_path / "rank-0.pt")
    for state in ({"distributed": []}, {"plain": {"state": {}, "param_groups": []}, "names": None},
                  {"state": {}, "param_groups": []}):
        ckpt.save_atomic(state, path)
        with pytest.raises(ValueError, match=r"agent 'a': the checkpoint's optimizer shards name "
                                             r"no parameters .* resume with the checkpoint's "
                                             r"\{'tp': 1"):
            megatron_trainer.moments_of_shards([path], old, arch, "a")

    def adam(step):
        return {"step": torch.tensor(float(step)), "exp_avg": torch.zeros(64),
                "exp_avg_sq": torch.zeros(64)}

    for shard, msg in (
            ({"decoder.final_layernorm.weight": {"step": torch.tensor(1.0),
                                                 "momentum_buffer": torch.zeros(64)}},
             r"optimizer state of 'decoder.final_layernorm.weight' has \['momentum_buffer', "
             r"'step'\], not Adam's"),
            ({"decoder.final_layernorm.weight": adam(1), "decoder.layers.0.x": adam(2)},
             r"the optimizer shards are at different steps \[1.0, 2.0\]"),
            ({"decoder.final_layernorm.weight": adam(1)},
             r"the optimizer shards hold no state for parameter 'embedding.word_embeddings"),
            ({"decoder.final_layernorm.weight": adam(1),
              "decoder.layers.0.x": {**adam(1), "main": torch.zeros(64)}},
             r"the optimizer shards hold fp32 main weights for some parameters only")):
        with pytest.raises(ValueError, match=msg):
            moments_to_hf([[shard]], arch)
    ckpt.save_atomic({"plain": {"state": {0: adam(1)}, "param_groups": [{"params": [0]}]},
                      "names": [[["decoder.final_layernorm.weight"]]]}, path)
    with pytest.raises(ValueError, match=r"agent 'a': the checkpoint's optimizer shards cannot "
                                         r"move to another layout: the optimizer shards hold no "
                                         r"state for parameter"):
        megatron_trainer.moments_of_shards([path], old, arch, "a")
    assert moments_to_hf([[{}]], arch) == (0.0, {})

    # the distributed optimizer's slices of one (tp, pp) shard, one per DP rank
    def piece(a, b, step=1.0, n=6):
        return {"step": torch.tensor(step), "exp_avg": torch.arange(a, b, dtype=torch.float32),
                "exp_avg_sq": torch.ones(b - a), "range": (a, b), "shape": (2, n // 2)}

    whole = join_slices([{"w": piece(3, 6)}, {"w": piece(0, 3)}])["w"]   # any rank order
    assert torch.equal(whole["exp_avg"], torch.arange(6.0).reshape(2, 3))
    assert set(whole) == {"step", "exp_avg", "exp_avg_sq"}
    for parts, msg in (
            ([{"w": piece(0, 3)}, {"w": piece(4, 6)}],
             r"the optimizer slices of 'w' cover \[\(0, 3\), \(4, 6\)\] of its 6 elements"),
            ([{"w": piece(0, 4)}, {"w": piece(3, 6)}], r"cover \[\(0, 4\), \(3, 6\)\]"),
            ([{"w": piece(0, 3)}], r"cover \[\(0, 3\)\] of its 6 elements"),
            ([{"w": piece(0, 3)}, {"w": piece(3, 6, step=2.0)}],
             r"the optimizer slices of 'w' are at different steps"),
            ([{"w": piece(0, 3)}, {"w": {**piece(3, 6), "main": torch.zeros(3)}}],
             r"the optimizer slices of 'w' hold different states"),
            ([{"w": adam(1)}], r"the optimizer state of 'w' is not a slice")):
        with pytest.raises(ValueError, match=msg):
            join_slices(parts)
    # tp / pp / dp and the optimizer kind may change together; the vocabulary padding not
    agents = object.__new__(megatron_trainer.MegatronAgents)
    agents.names = ["a"]
    agents._groups = [SimpleNamespace(torch=False, ranks=[None] * 2,
                                      par=ParallelConfig(dp=2, distributed_optimizer=True))]
    sd = {"model": {}, "megatron": {"tp": 2, "pp": 1, "dp": 2, "transformer_impl": "local",
                                    "make_vocab_size_divisible_by": 128,
                                    "distributed_optimizer": False}}
    with pytest.raises(ValueError, match=r"agent 'a': the checkpoint's megatron layout .*'tp': 2"
                                         r".* differs from this run's .*'tp': 1.*; optimizer "
                                         r"state moves to another tp / pp / dp / "
                                         r"distributed_optimizer only: resume with the "
                                         r"checkpoint's layout"):
        agents.load_state_dict(0, sd)


def test_shards_must_be_visible_to_the_driver(tmp_path):
    f = tmp_path / "rank-0.pt"
    f.write_bytes(b"x" * 10)
    megatron_trainer.check_shards_visible([{"path": str(f), "bytes": 10}], "agent 'a'")
    for w, seen in (({"path": str(tmp_path / "none.pt"), "bytes": 10}, "no such file"),
                    ({"path": str(f), "bytes": 11}, "10 bytes")):
        with pytest.raises(RuntimeError, match=rf"agent 'a': rank 1 wrote .* but the driver "
                                               rf"sees {seen}: out_dir must be on a filesystem "
                                               rf"shared by every node"):
            megatron_trainer.check_shards_visible([{"path": str(f), "bytes": 10}, w],
                                                  "agent 'a'")


def test_resumed_second_step_equals_torch_two_steps(cluster, tmp, torch_runs, megatron_step1):
    """Resume the 1-step megatron run to step 2 (fresh rank actors; HF weights and every rank's
    optimizer state from the checkpoint): both steps' metrics and the final weights equal the
    torch trainer's uninterrupted 2 steps (each rank reads its own optimizer shard; the step-1
    shards are deleted once the step-2 checkpoint is written); a copy of the run with one
    rank's shard cut short cannot resume (clear error: the checkpoint records each shard's
    size); another vocabulary padding cannot resume it. Step 2 runs in another layout (the
    TP=2 agent at PP=2, the PP=2 one at DP=2 with megatron's distributed optimizer: Adam's
    state moves by parameter name through HF names, as the weights do, and each DP rank takes
    its slice), with another weight bucket size (one bucket now) and log-prob path:
    ``parallel.lm_head = "logits"`` (megatron's output layer; step 1 used the fused default),
    so both paths are checked inside the trainer. A copy of step 1 resumed on one rank per
    agent (fewer ranks than wrote it) gives the same step 2."""
    with pytest.raises(ValueError, match=r"cannot resume.*agents\.0\.parallel\."
                                         r"make_vocab_size_divisible_by"):
        train(megatron_cfg(tmp, "meg", "megatron", steps=2).override(
            {"agents.0.parallel.make_vocab_size_divisible_by": 8}), resume=True,
            echo=lambda *_: None)
    dirs1, named1 = _shard_dirs(tmp, "meg")
    shutil.copytree(tmp / "meg", tmp / "meg-broken")
    with open(tmp / "meg-broken" / named1[NAMES[1]][1], "r+b") as f:   # a half-copied shard
        f.truncate(100)
    with pytest.raises(ValueError, match=rf"agent '{NAMES[1]}': the checkpoint's optimizer "
                                         rf"shards are missing or changed: .*rank-1\.pt "
                                         rf"\(100 bytes, written with \d+\)"):
        train(megatron_cfg(tmp, "meg-broken", "megatron", steps=2), resume=True,
              echo=lambda *_: None)
    free_cpus_back()
    shutil.copytree(tmp / "meg", tmp / "meg-fewer")       # step 1, for a resume on 1 rank
    # what a crash between the ranks' writes and the checkpoint file would leave behind
    stale = tmp / "meg" / "checkpoint-megatron" / NAMES[0] / "crashed-save"
    stale.mkdir()
    (stale / "rank-0.pt").write_bytes(b"partial")
    summary = train(megatron_cfg(tmp, "meg", "megatron", steps=2).override(
        {"agents.0.parallel.weight_bucket_mb": 1024, "agents.0.parallel.lm_head": "logits",
         "agents.1.parallel.lm_head": "logits", "agents.0.parallel.tp": 1,
         "agents.0.parallel.pp": 2, "agents.1.parallel.dp": 2, "agents.1.parallel.pp": 1,
         "agents.1.parallel.distributed_optimizer": True}),
        resume=True, echo=lambda *_: None)
    free_cpus_back()
    meg, ref = _rows(tmp, "meg"), _rows(tmp, "torch2")
    assert [r["step"] for r in meg] == [0, 1]
    for a, b in zip(meg, ref):
        _check_metrics(a, b)
    before = _initial_weights(tmp)
    _check_weights(_weights(tmp, "meg"), _weights(tmp, "torch2"), before)
    assert set(summary["after"]) == set(NAMES)
    dirs2, named2 = _shard_dirs(tmp, "meg")
    for a in NAMES:     # one directory each: the step-2 save's (not step 1's, not the crash's)
        assert len(dirs2[a]) == 1 and dirs2[a] != dirs1[a] and dirs2[a] != ["crashed-save"]
        assert all((tmp / "meg" / f).is_file() for f in named2[a])
    # the same step 1 resumed on fewer ranks than it was written by (2 -> 1 per agent: the
    # checkpoint's shards, weights and Adam moments, are read by its own layout's count and
    # cut for the new one): the same step 2
    train(megatron_cfg(tmp, "meg-fewer", "megatron", steps=2).override(
        {"agents.0.parallel.tp": 1, "agents.1.parallel.pp": 1}), resume=True,
        echo=lambda *_: None)
    free_cpus_back()
    fewer = _rows(tmp, "meg-fewer")
    assert [r["step"] for r in fewer] == [0, 1]
    for a, b in zip(fewer, ref):
        _check_metrics(a, b)
    _check_weights(_weights(tmp, "meg-fewer"), _weights(tmp, "torch2"), before)


KL = {"algorithm.loss.kl_coef": 1.0}


def _check_reference_shards(tmp, run: str, agents=AGENTS) -> dict[str, list[str]]:
    """Every rank's KL reference shard file, as the run's checkpoint names them (with their
    sizes), equals its shard of the warm start (the reference never trains). Returns
    {agent: the files}."""
    from hacpo.models.megatron import hf_to_megatron
    from hacpo.models.megatron.build import ArchSpec

    named = {a["name"]: a["megatron"]["ref_files"]
             for a in ckpt.load(tmp / run / "checkpoint.pt")["agents"]}
    for pol, (name, _, par) in zip(_warm_policies(tmp, agents), agents):
        arch = ArchSpec.from_hf(pol.model.config)
        assert len(named[name]) == par.world, name
        for i, f in enumerate(named[name]):
            path = tmp / run / f["path"]
            assert path.stat().st_size == f["bytes"] and f["path"].startswith(
                f"checkpoint-megatron/{name}/reference-"), f
            want = hf_to_megatron(pol.model.state_dict(), arch, tp=par.tp, tp_rank=i % par.tp,
                                  pp=par.pp, pp_rank=i // (par.tp * par.dp))
            got = ckpt.load(path)
            assert got.keys() == want.keys(), (name, i)
            assert all(torch.equal(got[k], want[k]) for k in want), (name, i)
    return {name: [f["path"] for f in files] for name, files in named.items()}


def test_kl_term_one_step_and_resume_equal_torch_trainer(cluster, tmp, torch_runs):
    """loss.kl_coef > 0 (a frozen reference shard on every rank, its log-probs computed with
    the old log-probs): one step, and a resumed second step (the reference reloaded from the
    checkpoint, not rebuilt from the resumed weights), equal the torch trainer's two steps with
    the same KL term; the term moves the weights well beyond the tolerance (against the no-KL
    torch run), so leaving it out, or a wrong reference at step 2, fails.

    The ranks write their reference shards once (checked against the warm start); agent 1
    resumes at TP=2 instead of PP=2: its reference shards are gathered to HF names and cut for
    the new layout (written anew at the step-2 save), its Adam state moved likewise. Agent 0's
    part of the step-1 checkpoint is first rewritten in the format from before the ranks wrote
    shards (optimizer states and the reference's HF weights inside
    the file, its shard files deleted): it must still resume exactly, and its step-2 save
    writes reference shards anew. A run whose reference shard changed cannot resume."""
    ref_run = train(megatron_cfg(tmp, "kl-torch", "torch", steps=2, **KL), echo=lambda *_: None)
    train(megatron_cfg(tmp, "kl-meg", "megatron", **KL), echo=lambda *_: None)
    free_cpus_back()
    before = _initial_weights(tmp)
    refs1 = _check_reference_shards(tmp, "kl-meg")
    # a changed shard file (here: truncated) is a clear error, before any rank loads it
    shutil.copytree(tmp / "kl-meg", tmp / "kl-broken")
    with open(tmp / "kl-broken" / refs1[NAMES[1]][0], "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=rf"agent '{NAMES[1]}': the checkpoint's KL reference "
                                         rf"shards are missing or changed: .*rank-0\.pt "
                                         rf"\(100 bytes, written with \d+\)"):
        train(megatron_cfg(tmp, "kl-broken", "megatron", steps=2, **KL), resume=True,
              echo=lambda *_: None)
    free_cpus_back()
    path = tmp / "kl-meg" / "checkpoint.pt"
    state = ckpt.load(path)
    old = state["agents"][0]
    assert old["name"] == NAMES[0]
    files = old["megatron"].pop("optim_files")
    old["megatron"].pop("optim_bytes")
    old["megatron"]["optim"] = [ckpt.load(tmp / "kl-meg" / f) for f in files]
    old["megatron"].pop("ref_files")
    old["megatron"]["ref_hf"] = {k[len("model."):]: v for k, v in before[NAMES[0]].items()
                                 if k.startswith("model.")}      # the warm start, HF names
    ckpt.save_atomic(state, str(path))
    shutil.rmtree(tmp / "kl-meg" / "checkpoint-megatron" / NAMES[0])
    summary = train(megatron_cfg(tmp, "kl-meg", "megatron", steps=2, **KL).override(
        {"agents.1.parallel.tp": 2, "agents.1.parallel.pp": 1}), resume=True,
        echo=lambda *_: None)
    free_cpus_back()
    meg, ref = _rows(tmp, "kl-meg"), _rows(tmp, "kl-torch")
    assert [r["step"] for r in meg] == [0, 1]
    for a, b in zip(meg, ref):
        _check_metrics(a, b)
        for name in NAMES:
            assert b[f"train/{name}/kl"] > 1e-6, name         # the reference is not the policy
            assert a[f"time/ref_logprobs/{name}"] > 0
    _check_weights(_weights(tmp, "kl-meg"), _weights(tmp, "kl-torch"), before)
    no_kl, with_kl = _weights(tmp, "torch2"), _weights(tmp, "kl-torch")
    for name in NAMES:
        gap = max((with_kl[name][k] - no_kl[name][k]).abs().max().item() for k in no_kl[name])
        assert gap > 10 * W_ATOL, f"{name}: the KL term barely moved the weights ({gap:.1e})"
    refs2 = _check_reference_shards(tmp, "kl-meg", (AGENTS[0], (NAMES[1], "char",
                                                                ParallelConfig(tp=2))))
    assert refs2[NAMES[1]] != refs1[NAMES[1]]          # written anew for the TP=2 layout
    assert refs2[NAMES[0]] != refs1[NAMES[0]]          # written from the old-format resume
    for name in NAMES:      # kept: this save's optimizer shards and the reference's
        root = tmp / "kl-meg" / "checkpoint-megatron" / name
        assert len(list(root.iterdir())) == 2, sorted(p.name for p in root.iterdir())
    assert set(summary["after"]) == set(NAMES) and ref_run["before"] == summary["before"]


# char-tp2: the character tokenizer's 91 ids at TP=2, padded to a multiple of 2*8: 96 rows
DP_AGENTS = (("llama-dp2", "llama3.2", ParallelConfig(dp=2)),
             ("char-tp2", "char", ParallelConfig(tp=2, make_vocab_size_divisible_by=8)))


@pytest.mark.parametrize("algorithm", ["hacpo", "grpo"])
def test_dp2_one_step_equals_torch_trainer(cluster, tmp, algorithm):
    """DP=2 (each rank trains its share of every minibatch; gradients summed by megatron's DDP
    with the minibatch's global divisor) next to a TP=2 group whose vocabulary (the character
    tokenizer's 91 ids) megatron pads to 96 rows: one step equals the torch
    trainer's, for HACPO (sequence-level, self + cross samples) and GRPO (token-level loss,
    divisor = the minibatch's response tokens)."""
    names = [a[0] for a in DP_AGENTS]
    over = {"algorithm.name": algorithm}
    train(megatron_cfg(tmp, f"dp-torch-{algorithm}", "torch", DP_AGENTS, **over),
          echo=lambda *_: None)
    train(megatron_cfg(tmp, f"dp-meg-{algorithm}", "megatron", DP_AGENTS, **over),
          echo=lambda *_: None)
    free_cpus_back()
    meg, ref = _rows(tmp, f"dp-meg-{algorithm}"), _rows(tmp, f"dp-torch-{algorithm}")
    _check_metrics(meg[0], ref[0], names)
    for name in names:
        assert (meg[0][f"train/{name}/trained_cross"] > 0) == (algorithm == "hacpo"), name
    _check_weights(_weights(tmp, f"dp-meg-{algorithm}"), _weights(tmp, f"dp-torch-{algorithm}"),
                   _initial_weights(tmp, DP_AGENTS), names)


MIX_AGENTS = (("llama-tp2-mix", "llama3.2", ParallelConfig(tp=2)),
              ("char-torch-mix", "char", None))


def test_megatron_and_torch_agents_in_one_run(cluster, tmp, monkeypatch):
    """A TP=2 megatron agent next to a trainer=torch agent (a Ray TrainerActor, as
    trainer_backend=ray runs it): one step equals the all-torch in-process run, and the two
    agents updated at once (the torch actor's update overlapped the ranks')."""
    names = [a[0] for a in MIX_AGENTS]
    train(megatron_cfg(tmp, "mix-torch", "torch", MIX_AGENTS), echo=lambda *_: None)
    cfg = megatron_cfg(tmp, "mix-meg", "megatron", MIX_AGENTS)
    assert [a.trainer for a in cfg.agents] == ["megatron", "torch"]
    seen = {}
    real_meg, real_torch = (megatron_trainer.MegatronAgents._update_result,
                            megatron_trainer.drawn_update_result)

    def meg_result(self, k, view, pool, mbs, results, *a, **kw):
        seen["megatron"] = [r["span"] for r in results]
        return real_meg(self, k, view, pool, mbs, results, *a, **kw)
    monkeypatch.setattr(megatron_trainer.MegatronAgents, "_update_result", meg_result)
    monkeypatch.setattr(megatron_trainer, "drawn_update_result", lambda result, *a: (
        seen.__setitem__("torch", result[4]) or real_torch(result, *a)))
    train(cfg, echo=lambda *_: None)
    free_cpus_back()
    (t0, t1), ranks = seen["torch"], seen["megatron"]
    assert len(ranks) == 2 and all(t0 < e and s < t1 for s, e in ranks), seen
    meg, ref = _rows(tmp, "mix-meg"), _rows(tmp, "mix-torch")
    _check_metrics(meg[0], ref[0], names)
    _check_weights(_weights(tmp, "mix-meg"), _weights(tmp, "mix-torch"),
                   _initial_weights(tmp, MIX_AGENTS), names)
    assert meg[0]["time/score_self/char-torch-mix"] > 0


def test_config_errors(cluster, tmp):
    """Layouts and backends megatron cannot run are clear errors before anything starts."""
    with pytest.raises(ValueError, match=r"agent 'llama-tp2'.*num_attention_heads=4 is not "
                                         r"divisible by tensor-parallel size tp=3"):
        megatron_cfg(tmp, "bad", "megatron").override({"agents.0.parallel.tp": 3})
    with pytest.raises(ValueError, match=r"num_hidden_layers=2 is not divisible by "
                                         r"pipeline-parallel size pp=4"):
        megatron_cfg(tmp, "bad", "megatron").override({"agents.1.parallel.pp": 4})
    with pytest.raises(ValueError, match=r"trainer=megatron.*set trainer_backend=ray"):
        megatron_cfg(tmp, "bad", "megatron").override({"trainer_backend": "local"})
    with pytest.raises(ValueError, match=r"needs an HF policy"):
        megatron_cfg(tmp, "bad", "megatron").override({"agents.0.policy.kind": "decoder"})
    with pytest.raises(ValueError, match=r"'llama' or 'qwen2'.*'gpt2'"):
        megatron_cfg(tmp, "bad", "megatron").override({"agents.0.policy.arch": "gpt2"})
    with pytest.raises(ValueError, match=r"unknown trainer 'deepspeed'"):
        megatron_cfg(tmp, "bad", "megatron").override({"agents.1.trainer": "deepspeed"})
    with pytest.raises(ValueError, match=r"trainer_setup_hook must look like"):
        megatron_cfg(tmp, "bad", "megatron").override({"trainer_setup_hook": "no-colon"})
    with pytest.raises(ValueError, match=r"parallel.make_vocab_size_divisible_by must be an "
                                         r"integer >= 1, got 0"):
        megatron_cfg(tmp, "bad", "megatron").override(
            {"agents.1.parallel.make_vocab_size_divisible_by": 0})
    # the vocabulary is the tokenizer's (91 ids): padded to 2*128 = 256 rows, TP rank 1's 128
    # rows would all be padding; checked once the policies are built, before the warm-up (it
    # was checked after it, when the group started, as a traceback) and any actor
    from hacpo.engine.errors import is_user_error
    pad = megatron_cfg(tmp, "bad", "megatron").override(
        {"agents.1.parallel.tp": 2, "agents.1.parallel.pp": 1,
         "agents.1.parallel.make_vocab_size_divisible_by": 128})
    said = []
    with pytest.raises(ValueError, match=r"agent 'char-pp2'.*tokenizer 'char'.*vocab_size=91 "
                                         r"padded to 256.*rank 1 .*would hold only padding") as e:
        train(pad, echo=said.append)
    assert is_user_error(e.value) and not any("warm-up" in s for s in said), said
    free_cpus_back()
    # full recomputation in chunks of 2 layers, where a stage holds 1 (2 layers at PP=2)
    deep = megatron_cfg(tmp, "bad", "megatron").override(
        {"agents.1.parallel.recompute": "full", "agents.1.parallel.recompute_num_layers": 2})
    with pytest.raises(ValueError, match=r"agent 'char-pp2'.*recompute_num_layers=2 does not "
                                         r"divide a pipeline stage's 1 layer\(s\)") as e:
        train(deep, echo=said.append)
    assert is_user_error(e.value) and not any("warm-up" in s for s in said), said
    free_cpus_back()


def test_checkpoint_from_before_the_trainer_fields_resumes():
    """A checkpoint written before agents.N.trainer / parallel and trainer_setup_hook existed
    resumes with them at their defaults, and not as trainer=megatron."""
    from hacpo.engine.run_config import config_diff, default_fingerprint, fingerprint_dict
    torch_cfg = megatron_cfg(Path("/nonexistent"), "x", "torch")
    old = json.loads(json.dumps(fingerprint_dict(torch_cfg)))
    for a in old["agents"]:
        del a["trainer"], a["parallel"]
    assert "trainer_setup_hook" not in fingerprint_dict(torch_cfg)   # site setting
    assert config_diff(old, fingerprint_dict(torch_cfg),
                       defaults=default_fingerprint(torch_cfg)) == []
    meg = megatron_cfg(Path("/nonexistent"), "x", "megatron")
    diff = config_diff(old, fingerprint_dict(meg), defaults=default_fingerprint(meg))
    # (the layouts' tp / pp may change on resumption: no difference there)
    assert {"agents.0.trainer", "agents.1.trainer"} <= set(diff), diff
    vocab = meg.override({"agents.0.parallel.make_vocab_size_divisible_by": 8})
    assert "agents.0.parallel" in config_diff(old, fingerprint_dict(vocab),
                                              defaults=default_fingerprint(vocab))


def test_missing_setup_hook_is_clear_error(cluster, tmp):
    """Without the CPU patches megatron-core's own CUDA call fails in the rank: the error names
    the agent and carries megatron's message (no silent CPU fallback in library code)."""
    cfg = megatron_cfg(tmp, "nohook", "megatron")
    cfg = dataclasses.replace(cfg, agents=cfg.agents[1:], trainer_setup_hook="")
    cfg = cfg.override({"agents.0.parallel.pp": 1})
    with pytest.raises(RuntimeError, match=r"megatron trainer rank of agent 'char-pp2' failed"
                                           r"(.|\n)*Torch not compiled with CUDA enabled"
                                           r"(.|\n)*needs a trainer_setup_hook"):
        train(cfg, echo=lambda *_: None)
    free_cpus_back()


def test_killed_rank_actor_is_clear_error(cluster, tmp, monkeypatch):
    """SIGKILL rank 1 of the TP=2 group during a run: train raises promptly, naming the agent
    and the rank and pointing to --resume; every rank actor is gone afterwards."""
    groups = capture_instances(monkeypatch, megatron_trainer.MegatronAgents)
    metrics = tmp / "killed" / "metrics.jsonl"
    th, out = run_in_thread(lambda: train(megatron_cfg(tmp, "killed", "megatron", steps=40),
                                          echo=lambda *_: None))
    wait_for_first_step(metrics, th, out, 150)
    pid = ray.get(groups[0].rank_actor(0, 1).ready.remote())
    os.kill(pid, signal.SIGKILL)
    th.join(timeout=120)
    assert not th.is_alive()
    err = out.get("err")
    assert isinstance(err, RuntimeError), out
    assert "megatron trainer rank 1 of agent 'llama-tp2' died" in str(err)
    assert "--resume" in str(err)
    free_cpus_back()                        # the run cleaned up its actors
    assert 1 <= metrics.read_text().count("\n") < 40


def test_rank_stage_clock_synchronizes_the_device_with_profile_sync():
    """A rank's stage times (score / backward / optimizer, old log-probs) read its clock
    ``_now``: with ``profile_sync`` on CUDA it synchronizes the device first (set in setup, where
    the rank knows its device), so a stage's time holds its kernels; by default, and on CPU, it
    does not synchronize."""
    rank = megatron_trainer.MegatronRank("a", 0, 1, 1, "")
    assert rank._sync is None
    calls = []
    rank._sync = lambda: calls.append(len(calls))
    t0 = rank._now()
    t1 = rank._now()
    assert calls == [0, 1] and t1 >= t0
    # the choice setup makes: only profile_sync on a CUDA device synchronizes
    from hacpo.engine.timing import device_sync
    assert device_sync(False) is None
    if not torch.cuda.is_available():
        assert device_sync(True) is None


def test_zero_steps_checkpoint_resumes_into_megatron_groups(cluster, tmp, torch_runs):
    """steps=0 saves the warm start as a step-0 checkpoint (no optimizer step yet: the ranks'
    optimizer shards hold empty Adam state); --resume with steps=1 starts fresh rank actors from
    it and its step equals the torch trainer's first step."""
    quiet = dict(echo=lambda *_: None)
    train(megatron_cfg(tmp, "meg0", "megatron", steps=0), **quiet)
    assert ckpt.load(tmp / "meg0" / "checkpoint.pt")["step"] == 0
    train(megatron_cfg(tmp, "meg0", "megatron", steps=1), resume=True, **quiet)
    got, ref = _rows(tmp, "meg0"), _rows(tmp, "torch1")
    assert [r["step"] for r in got] == [0]
    _check_metrics(got[0], ref[0])
    _check_weights(_weights(tmp, "meg0"), _weights(tmp, "torch1"), _initial_weights(tmp))
