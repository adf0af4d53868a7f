"""`hacpo eval` of a run's checkpoint on the run's own held-out set equals the run's final
greedy evaluation (summary.json), problem by problem, for the training backends other than the
local trainer (tests/engine/test_eval_harness.py): Ray trainer actors with the Ray rollout pool
(tiny3's first two agents) evaluating (eval_engine=rollout), and megatron-core rank groups (TP=2
and PP=2, the driver's HF copies evaluating, the checkpoint holding the weights the ranks
trained); the megatron agents also exported (`hacpo export`) and run by transformers alone."""
import dataclasses

import pytest

from hacpo.engine.run_config import load_config
from hacpo.engine.trainer import train

from tests.engine.test_eval_harness import (OWN_RUN, assert_eval_equals_run,
                                            record_final_responses)
from tests.engine.test_export import assert_export_answers_as_run

from ._launch_helpers import free_cpus_back


def test_ray_trainer_and_ray_rollout_pool(cluster, tmp_path, monkeypatch):
    own = record_final_responses(monkeypatch)
    cfg = load_config("tiny3", overrides={
        "out_dir": str(tmp_path / "run"), "cache_dir": str(tmp_path / "cache"), **OWN_RUN,
        "trainer_backend": "ray", "rollout.engine": "ray", "eval_engine": "rollout"})
    cfg = dataclasses.replace(cfg, agents=cfg.agents[:2])   # 2 actors each: the 4 CPUs
    summary = train(cfg, echo=lambda *_: None)
    free_cpus_back()
    own = dict(own)
    assert sorted(own) == ["char", "qwen3"]
    assert_eval_equals_run(tmp_path / "run", summary, tmp_path / "ev", own)


@pytest.mark.slow
def test_megatron_agents(cluster, tmp_path, monkeypatch):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from tests.launch.test_megatron_trainer import megatron_cfg
    own = record_final_responses(monkeypatch)
    over = {k: v for k, v in OWN_RUN.items() if not k.startswith("agents.")}
    over.update({f"agents.{k}.{key}": v for k in range(2)
                 for key, v in (("warmup.steps", 150), ("optim.lr", 1e-4))})
    cfg = megatron_cfg(tmp_path, "run", "megatron", **over)
    assert [a.trainer for a in cfg.agents] == ["megatron", "megatron"]
    summary = train(cfg, echo=lambda *_: None)
    free_cpus_back()
    own = dict(own)
    assert sorted(own) == ["char-pp2", "llama-tp2"]
    assert_eval_equals_run(tmp_path / "run", summary, tmp_path / "ev", own)
    # the megatron-trained agents exported (their checkpoint holds the HF copy gathered from
    # the TP / PP shards): transformers alone answers as the run did
    assert_export_answers_as_run(tmp_path / "run", tmp_path / "hf", own, "megatron")
