"""Two HACPO steps with two tiny HF agents whose rollouts come from real vLLM engines."""
import json
import os

import pytest

from hacpo.engine import build
from hacpo.engine.trainer import train

from .conftest import tiny_policy_configs, vllm_config

pytestmark = pytest.mark.slow


def test_train_two_steps_with_vllm_rollouts(tmp_path, monkeypatch):
    """... and with eval_engine="rollout" the held-out evaluation (before and after training)
    is sampled greedily by the vLLM engines, not by the driver's copies."""
    import ray

    from hacpo.launch.vllm_rollout import VLLMRolloutEngine

    configs = tiny_policy_configs()
    cfg = vllm_config(configs, group_size=2, max_new_tokens=8)
    cfg = cfg.override({"steps": 2, "prompts_per_step": 2, "out_dir": str(tmp_path / "run"),
                        "cache_dir": str(tmp_path / "cache"), "progress": False,
                        "plots": False, "tensorboard": False, "checkpoint_every": 2,
                        "data.train_size": 16, "data.eval_size": 2, "eval_engine": "rollout",
                        "drop_unencodable": False})   # the random agents' cross samples
    calls, events = [], []
    gen, idle, sync = (VLLMRolloutEngine.generate, VLLMRolloutEngine.idle,
                       VLLMRolloutEngine.sync_weights)
    monkeypatch.setattr(VLLMRolloutEngine, "generate", lambda self, k, p, **kw: (
        calls.append((k, len(p), kw["temperature"])) or events.append(f"gen{k}")
        or gen(self, k, p, **kw)))
    monkeypatch.setattr(VLLMRolloutEngine, "idle", lambda self: (
        events.append("idle") or idle(self)))
    monkeypatch.setattr(VLLMRolloutEngine, "sync_weights", lambda self, k: (
        events.append(f"sync{k}") or sync(self, k)))
    engines = []

    def capture(cfg_, policies, agents=None):
        engines.append(build_engine(cfg_, policies, agents))
        return engines[-1]

    build_engine = build.rollout_engine
    monkeypatch.setattr(build, "rollout_engine", capture)
    connected = ray.is_initialized()
    summary = train(cfg, echo=lambda *a: None)

    engine, = engines
    assert type(engine).__name__ == "VLLMRolloutEngine"
    # one sync before step 0, one after each agent's update in each of the 2 steps
    assert engine.stats() == {"restarts": [[0], [0]], "timeouts": [[0], [0]], "versions": [3, 3]}
    assert engine._closed and ray.is_initialized() == connected   # its private cluster is gone
    assert summary["steps"] == 2 and summary["agents"] == [c.name for c in configs]
    with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 2
    for row in rows:
        for c in configs:
            assert row[f"time/generate/{c.name}"] > 0
            assert f"reward/{c.name}" in row
    for c in configs:         # the vLLM samples re-tokenized for the other agent, trained on
        assert sum(r[f"train/{c.name}/cross_count"] for r in rows) > 0, c.name
    # engine counters in the metrics, summed over agents and engines: 2 + 2 syncs after the
    # initial one per agent by the end of step 0, 3 + 3 after step 1
    assert [r["rollout/versions"] for r in rows] == [4.0, 6.0]
    assert all(r["rollout/restarts"] == 0 and r["rollout/timeouts"] == 0 for r in rows)
    # the engines are idle (colocated: asleep) from each step's generation to the weight
    # syncs after the updates; evaluation before and after (one agent after another); both
    # agents sample at once in a step (generate_agents) and take their weights at once
    # (sync_agents, also at the start), so those pairs of calls come in either order
    step = ["gen*", "gen*", "idle", "sync*", "sync*"]
    seen = ["sync*" if e.startswith("sync") else
            "gen*" if 4 <= i < 14 and e.startswith("gen") else e for i, e in enumerate(events)]
    assert seen == ["sync*", "sync*", "gen0", "gen1", *step, *step, "gen0", "gen1"], events
    assert sorted(events[4:6]) == sorted(events[9:11]) == ["gen0", "gen1"], events
    assert (sorted(events[0:2]) == sorted(events[7:9]) == sorted(events[12:14])
            == ["sync0", "sync1"]), events
    # evaluation: greedy requests of the 2 held-out prompts per agent, before and after
    greedy = sorted((k, n) for k, n, t in calls if t == 0.0)
    assert greedy == [(0, 2), (0, 2), (1, 2), (1, 2)], calls
    for when in ("before", "after"):
        assert all(0.0 <= summary[when][c.name]["accuracy"] <= 1.0 for c in configs)
