"""The megatron trainer's checkpoint bookkeeping that its end-to-end tests
(test_megatron_trainer.py, test_megatron_layouts.py, test_crash_resume.py) do not reach, each
checked without Ray on stand-in ranks and files in a temporary out_dir:

- ``weights_of_shards``: a KL reference's per-rank shard files of a TP=2 x PP=2 x DP=2 layout
  gathered back to the HF weights they were cut from;
- ``moments_of_shards``: which optimizer shard files it reads, and with which (tp, pp, dp)
  coordinates it hands them on (the plain optimizer: DP rank 0's of every shard only; the
  distributed optimizer: every DP rank's slice);
- ``MegatronAgents.load_state_dict``: a resume on fewer ranks than the checkpoint's (the shard
  files counted by the checkpoint's layout, the reference gathered from its shards and cut for
  the new one, never taken from the policy's weights, and written anew at the next save), the
  stale shard directories a crash left pruned, a checkpoint of another layout or without
  megatron state a clear error, a trainer=torch agent's driver copy loaded too;
- ``checkpoint_saved``: only the directories the last checkpoint names are kept;
- ``evaluate`` (each agent its own prompts) and ``close`` (actors and placement groups
  released once).
"""
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

import ray  # noqa: E402

from hacpo.engine import checkpoint as ckpt  # noqa: E402
from hacpo.engine.run_config import ParallelConfig  # noqa: E402
from hacpo.launch import megatron_trainer  # noqa: E402
from hacpo.launch.megatron_trainer import MegatronAgents  # noqa: E402
from hacpo.models.megatron import hf_to_megatron  # noqa: E402
from hacpo.models.megatron.build import ArchSpec  # noqa: E402
from hacpo.models.policy import PolicyConfig, build_policy  # noqa: E402

# hidden 32 = 4 heads x 8 (2 kv heads), 2 layers: splits at TP=2 and at PP=2
HF = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2}


def _policy(seed: int):
    return build_policy(PolicyConfig(name="a", kind="hf", arch="llama", tokenizer="char",
                                     hf_config=HF, seed=seed))


def _hf(pol) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pol.model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_weights_of_shards_joins_every_stage_and_tp_shard(tmp_path):
    """A TP=2 x PP=2 x DP=2 reference's 8 shard files (megatron's rank order: TP fastest, then
    DP, then PP; each DP replica a copy of its (tp, pp) shard) gather back to exactly the HF
    weights they were cut from."""
    pol = _policy(0)
    arch = ArchSpec.from_hf(pol.model.config)
    hf = _hf(pol)
    files = []
    for i in range(8):
        tp_rank, pp_rank, _ = megatron_trainer.rank_coords(i, 2, 2)
        files.append(str(tmp_path / f"rank-{i}.pt"))
        ckpt.save_atomic(hf_to_megatron(hf, arch, tp=2, tp_rank=tp_rank, pp=2,
                                        pp_rank=pp_rank), files[-1])
    got = megatron_trainer.weights_of_shards(
        files, {"tp": 2, "pp": 2, "dp": 2, "transformer_impl": "local"}, arch)
    want = {k: v for k, v in hf.items() if k in got}
    assert set(hf) - set(got) <= {"lm_head.weight"}      # tied to the embedding
    assert "model.layers.0.self_attn.q_proj.weight" in got and \
        "model.layers.1.mlp.down_proj.weight" in got       # both stages
    assert _same(got, want)


@pytest.mark.parametrize("sliced", [False, True])
def test_moments_of_shards_reads_dp_rank_0_or_every_slice(tmp_path, monkeypatch, sliced):
    """tp=2 x dp=2 x pp=2 optimizer shards: the plain optimizer's DP replicas hold the same
    state, so only DP rank 0's file of every (tp, pp) shard is read (the driver holds one copy
    of the moments, not dp); the distributed optimizer's DP ranks each hold a slice, so every
    file is read and handed on with its coordinates; the loss scaler states are rank 0's."""
    from hacpo.models.megatron import policy as mpol

    files = []
    for i in range(8):
        files.append(str(tmp_path / f"rank-{i}.pt"))
        ckpt.save_atomic({"i": i}, files[-1])
    loaded, handed = [], []
    real_load = ckpt.load

    def load(path, *a, **kw):
        loaded.append(os.path.basename(str(path)))
        return real_load(path, *a, **kw)

    def of_layout(named, tp, pp, *, sliced, arch, transformer_impl):
        handed.append((named, tp, pp, sliced, arch, transformer_impl))
        return 3.0, {"exp_avg": {}}

    monkeypatch.setattr(ckpt, "load", load)
    monkeypatch.setattr(mpol, "named_moments", lambda state: {"w": state["i"]})
    monkeypatch.setattr(mpol, "grad_scaler_states", lambda state: [f"scaler-{state['i']}"])
    monkeypatch.setattr(mpol, "moments_of_layout", of_layout)
    old = {"tp": 2, "pp": 2, "dp": 2, "transformer_impl": "local",
           "distributed_optimizer": sliced}
    assert megatron_trainer.moments_of_shards(files, old, "ARCH", "a") == (
        3.0, {"exp_avg": {}}, ["scaler-0"])
    ranks = range(8) if sliced else (0, 1, 4, 5)     # dp_rank = (i // tp) % dp
    assert loaded == [f"rank-{i}.pt" for i in ranks]
    assert len(handed) == 1
    named, tp, pp, got_sliced, arch, impl = handed[0]
    assert (tp, pp, got_sliced, arch, impl) == (2, 2, sliced, "ARCH", "local")
    assert named == [(megatron_trainer.rank_coords(i, 2, 2), {"w": i}) for i in ranks]


def _agents(tmp_path, par, pol, kl: bool, ranks) -> MegatronAgents:
    agents = object.__new__(MegatronAgents)
    agents.out_dir, agents.names, agents.policies, agents.kl = str(tmp_path), ["a"], [pol], kl
    agents._groups = [SimpleNamespace(torch=False, ranks=ranks, par=par, pg="pg-a")]
    agents._ref_files, agents._shard_dirs = [None], [None]
    agents._stale, agents._published = [True], ["old-buckets"]
    agents._gather = lambda k, refs: refs
    return agents


class _Rank:
    def __init__(self):
        self.loaded = []
        self.load = SimpleNamespace(remote=lambda *a: self.loaded.append(a) or os.getpid())


def test_resume_on_fewer_ranks_cuts_the_checkpoints_shards_for_the_new_layout(
        tmp_path, monkeypatch):
    """A checkpoint written at TP=2 (2 ranks: 2 optimizer and 2 KL reference shard files)
    resumed at TP=1 (1 rank): the files are counted by the checkpoint's layout; the reference
    is gathered from its shard files (another model than the checkpoint's policy weights) and
    cut for the one rank, with the optimizer state moved from the checkpoint's shards; the
    reference shards are written anew at the next save (the old ones are TP=2's); the driver's
    policy holds the checkpoint's weights; a directory the checkpoint does not name (a crashed
    save) is deleted, the named ones kept."""
    monkeypatch.setattr(ray, "put", lambda x: x)
    pol, saved, ref_pol = _policy(0), _policy(1), _policy(2)
    arch = ArchSpec.from_hf(pol.model.config)
    root = tmp_path / "checkpoint-megatron" / "a"
    for d in ("save1", "reference-r", "crashed"):
        (root / d).mkdir(parents=True)
    optim, refs = [], []
    for i in range(2):
        (root / "save1" / f"rank-{i}.pt").write_bytes(b"x" * (10 + i))
        optim.append(f"checkpoint-megatron/a/save1/rank-{i}.pt")
        path = root / "reference-r" / f"rank-{i}.pt"
        ckpt.save_atomic(hf_to_megatron(_hf(ref_pol), arch, tp=2, tp_rank=i), str(path))
        refs.append({"path": f"checkpoint-megatron/a/reference-r/rank-{i}.pt",
                     "bytes": path.stat().st_size})
    (root / "crashed" / "rank-0.pt").write_bytes(b"partial")
    moved = []

    def moments(files, old, arch_of, agent):
        moved.append((files, old["tp"], old["pp"], old["dp"]))
        return 0.0, {}, None                    # no update had run: a fresh state

    monkeypatch.setattr(megatron_trainer, "moments_of_shards", moments)
    rank = _Rank()
    agents = _agents(tmp_path, ParallelConfig(), pol, True, [rank])
    sd = {"model": saved.state_dict(),
          "megatron": {"tp": 2, "pp": 1, "dp": 1, "transformer_impl": "local",
                       "make_vocab_size_divisible_by": 1, "distributed_optimizer": False,
                       "optim_files": optim, "optim_bytes": [10, 11], "ref_files": refs}}
    agents.load_state_dict(0, sd)
    assert moved == [([str(tmp_path / f) for f in optim], 2, 1, 1)]
    assert len(rank.loaded) == 1
    weights, opt, ref = rank.loaded[0]
    assert _same(weights, hf_to_megatron(_hf(saved), arch))
    assert opt == {"moved": {}, "grad_scalers": None}
    assert _same(ref, hf_to_megatron(_hf(ref_pol), arch))
    assert _same(_hf(pol), _hf(saved))
    assert agents._ref_files == [None]          # TP=2's shards: the next save writes TP=1's
    assert agents._stale == [False] and agents._published == [None]
    assert sorted(os.listdir(root)) == ["reference-r", "save1"]


def test_resume_that_cannot_be_taken_is_clear_error(tmp_path):
    """A checkpoint without megatron state (trainer=torch's), one from before vocabulary
    padding existed (its layout had none) resumed with padding, and one of another
    transformer_impl: each a clear error naming the agent, before any rank loads."""
    rank = _Rank()
    agents = _agents(tmp_path, ParallelConfig(make_vocab_size_divisible_by=8), _policy(0),
                     False, [rank])
    with pytest.raises(ValueError, match=r"agent 'a': the checkpoint holds no megatron trainer "
                                         r"state \(written with trainer=torch\?\)"):
        agents.load_state_dict(0, {"model": {}})
    before = {"tp": 1, "pp": 1, "dp": 1, "transformer_impl": "local", "optim": [{}]}
    with pytest.raises(ValueError, match=r"agent 'a': the checkpoint's megatron layout .*"
                                         r"'make_vocab_size_divisible_by': 1.* differs from "
                                         r"this run's .*'make_vocab_size_divisible_by': 8"):
        agents.load_state_dict(0, {"model": {}, "megatron": before})
    agents = _agents(tmp_path, ParallelConfig(), _policy(0), False, [rank])
    with pytest.raises(ValueError, match=r"agent 'a': the checkpoint's megatron layout .*"
                                         r"'transformer_engine'.* differs from this run's"):
        agents.load_state_dict(0, {"model": {}, "megatron": {
            **before, "transformer_impl": "transformer_engine",
            "make_vocab_size_divisible_by": 1, "distributed_optimizer": False}})
    assert rank.loaded == []


def test_resume_of_a_torch_agent_loads_its_actor_and_the_driver_copy(tmp_path):
    """A trainer=torch agent among megatron ones: its trainer actor and the driver's policy
    both take the checkpoint's weights."""
    pol, saved = _policy(0), _policy(1)
    got = []
    actor = SimpleNamespace(load_state_dict=SimpleNamespace(remote=got.append))
    agents = _agents(tmp_path, None, pol, False, [actor])
    agents._groups[0].torch = True
    sd = {"model": saved.state_dict(), "optimizer": {"state": {}}}
    agents.load_state_dict(0, sd)
    assert got == [sd]
    assert _same(_hf(pol), _hf(saved))


def test_checkpoint_saved_keeps_only_the_named_directories(tmp_path):
    """After a checkpoint is written: each megatron agent keeps the optimizer shard directory
    of its last save and its KL reference's (written once per run); older saves and a crashed
    save's directory are deleted; an agent without a save (trainer=torch) is left alone."""
    for name, dirs in (("a", ("save1", "save2", "reference-r", "crashed")),
                       ("b", ("save1",))):
        for d in dirs:
            (tmp_path / "checkpoint-megatron" / name / d).mkdir(parents=True)
            (tmp_path / "checkpoint-megatron" / name / d / "rank-0.pt").write_bytes(b"x")
    agents = object.__new__(MegatronAgents)
    agents.out_dir, agents.names = str(tmp_path), ["a", "b"]
    agents._shard_dirs = [str(tmp_path / "checkpoint-megatron" / "a" / "save2"), None]
    agents._ref_files = [[{"path": "checkpoint-megatron/a/reference-r/rank-0.pt",
                           "bytes": 1}], None]
    agents.checkpoint_saved()
    assert sorted(os.listdir(tmp_path / "checkpoint-megatron" / "a")) == ["reference-r",
                                                                           "save2"]
    assert (tmp_path / "checkpoint-megatron" / "a" / "save2" / "rank-0.pt").is_file()
    assert (tmp_path / "checkpoint-megatron" / "a" / "reference-r" / "rank-0.pt").is_file()
    assert os.listdir(tmp_path / "checkpoint-megatron" / "b") == ["save1"]


def test_evaluate_scores_each_agent_on_its_own_prompts(monkeypatch):
    """Each agent's policy is evaluated on the prompts tokenized for it (the agents'
    tokenizers differ), after its weights are pulled to the driver."""
    calls, pulled = [], []
    monkeypatch.setattr(megatron_trainer, "evaluate_policy",
                        lambda p, ids, golds, rc, **kw: calls.append((p, ids, golds, rc, kw))
                        or {"acc": float(len(calls))})
    agents = object.__new__(MegatronAgents)
    agents.policies = ["pol-0", "pol-1"]
    agents.pull_weights = pulled.append
    ids = [[[1, 2]], [[3, 4, 5]]]
    assert agents.evaluate(ids, ["g"], "rc", max_new_tokens=4) == [{"acc": 1.0}, {"acc": 2.0}]
    assert pulled == [0, 1]
    assert calls == [("pol-0", ids[0], ["g"], "rc", {"max_new_tokens": 4}),
                     ("pol-1", ids[1], ["g"], "rc", {"max_new_tokens": 4})]


def test_close_releases_every_actor_and_placement_group_once(monkeypatch):
    released, shut = [], []
    monkeypatch.setattr(megatron_trainer.RayCluster, "release",
                        staticmethod(lambda actors, pgs: released.append((actors, pgs))))
    agents = object.__new__(MegatronAgents)
    agents._closed = False
    agents._groups = [SimpleNamespace(ranks=["r0", "r1"], pg="pg-0"),
                      SimpleNamespace(ranks=["t0"], pg="pg-1")]
    agents.cluster = SimpleNamespace(shutdown=lambda: shut.append(1))
    agents.close()
    agents.close()
    assert released == [(["r0", "r1", "t0"], ["pg-0", "pg-1"])]
    assert shut == [1] and agents._groups == []


def test_saves_write_the_reference_once_and_checkpoint_saved_drops_older_saves(tmp_path):
    """state_dict on stand-in ranks that write their shard files: every save names a fresh
    directory of optimizer shards (one file per rank, with the sizes written) and the same KL
    reference shards, written at the first save only (the reference never trains);
    checkpoint_saved after the second save deletes the first save's directory."""
    class Writer:
        def __init__(self, i):
            self.save_optim = SimpleNamespace(remote=lambda path: self._write(path, 5 + i))
            self.save_reference = SimpleNamespace(remote=lambda path: self._write(path, 7 + i))

        @staticmethod
        def _write(path, n):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(b"x" * n)
            return {"path": path, "bytes": n}

    pol = _policy(0)
    agents = _agents(tmp_path, ParallelConfig(tp=2), pol, True, [Writer(0), Writer(1)])
    agents.pull_weights = lambda k: None
    first = agents.state_dict(0)["megatron"]
    agents.checkpoint_saved()
    second = agents.state_dict(0)["megatron"]
    agents.checkpoint_saved()
    for meg in (first, second):
        assert (meg["tp"], meg["pp"], meg["dp"]) == (2, 1, 1)
        assert [os.path.basename(f) for f in meg["optim_files"]] == ["rank-0.pt", "rank-1.pt"]
        assert meg["optim_bytes"] == [5, 6]
    assert os.path.dirname(first["optim_files"][0]) != os.path.dirname(second["optim_files"][0])
    assert second["ref_files"] == first["ref_files"]
    assert [f["bytes"] for f in first["ref_files"]] == [7, 8]
    left = {os.path.relpath(os.path.join(r, f), tmp_path)
            for r, _, fs in os.walk(tmp_path / "checkpoint-megatron") for f in fs}
    assert left == set(second["optim_files"]) | {f["path"] for f in second["ref_files"]}
