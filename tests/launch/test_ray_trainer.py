"""Trainer groups as Ray actors (trainer_backend=ray) against a real local Ray cluster
(loopback, private temp dir, 4 logical CPUs; one cluster for the module): a 2-agent run, its
actors updating at once, gives metrics identical to the in-process backend (also with the Ray
rollout pool, and across a resume), and a killed trainer actor is a clear error naming its
agent."""
import json
import os
import signal

import pytest

from hacpo.engine.run_config import load_config
from hacpo.engine.trainer import train
from hacpo.launch import ray_trainer

from ._launch_helpers import (capture_instances, free_cpus_back, run_in_thread, two_agent_cfg,
                              wait_for_first_step)

import ray


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One warm-up cache for the module's runs, and the local backend's reference run."""
    tmp = tmp_path_factory.mktemp("trainer")
    return tmp


def _strip_times(rows):
    """Rows without wall times and the Ray rollout pool's fault counters (rollout/*), which
    the in-process engine does not report."""
    return [{k: v for k, v in r.items()
             if not k.startswith(("time/", "reward_fn/seconds", "rollout/"))} for r in rows]


def _run(tmp, name, resume=False, **over):
    cfg = two_agent_cfg(tmp, name, **over)
    summary = train(cfg, resume=resume, echo=lambda *_: None)
    rows = [json.loads(l) for l in open(tmp / name / "metrics.jsonl")]
    return summary, rows


@pytest.fixture(scope="module")
def local_run(cache):
    return _run(cache, "local", steps=2)


@pytest.mark.parametrize("rollout", ["local", "ray"])
def test_ray_trainer_equals_local(cluster, cache, local_run, rollout, monkeypatch):
    """2 agents x 2 steps with every agent's policy, optimizer and updates in a Ray actor:
    metrics step for step (all but wall times) and held-out results equal the in-process
    backend's; with rollout.engine=ray the pool shares the cluster. The two actors update at
    once (RayAgents.update_all): in every step agent 1's actor started its updates before
    agent 0's had finished (one agent after another, it is sent its request only after agent
    0's result is back)."""
    spans = []
    real = ray_trainer.drawn_update_result
    monkeypatch.setattr(ray_trainer, "drawn_update_result",
                        lambda result, *a: spans.append(result[4]) or real(result, *a))
    s_loc, r_loc = local_run
    s_ray, r_ray = _run(cache, f"ray-{rollout}", steps=2, trainer_backend="ray",
                        **{"rollout.engine": rollout})
    assert len(spans) == 4                     # 2 steps x 2 agents, in agent order
    for (a0, a1), (b0, b1) in zip(spans[0::2], spans[1::2]):
        assert b0 < a1 and a0 < b1, spans      # overlapping calls
    assert [r["step"] for r in r_ray] == [0, 1]
    assert _strip_times(r_ray) == _strip_times(r_loc)
    if rollout == "ray":
        assert [r["rollout/restarts"] for r in r_ray] == [0.0, 0.0]
    assert s_ray["after"] == s_loc["after"] and s_ray["before"] == s_loc["before"]
    for name in ("char", "qwen3"):           # stage times come back from the actors
        assert r_ray[-1][f"time/score_self/{name}"] > 0
        assert r_ray[-1][f"time/old_logprobs/{name}"] > 0
        assert r_ray[-1][f"train/{name}/trained_self"] > 0
    assert ray.is_initialized()              # the module's cluster is left running
    free_cpus_back()


def test_ray_trainer_resume_equals_uninterrupted(cluster, cache, local_run):
    """A ray-backend run stopped after step 1 and resumed (fresh actors, state from the
    checkpoint) to step 2 gives the uninterrupted run's metrics and results."""
    s_loc, r_loc = local_run
    _run(cache, "resumed", steps=1, trainer_backend="ray")
    s_res, r_res = _run(cache, "resumed", resume=True, steps=2, trainer_backend="ray")
    assert [r["step"] for r in r_res] == [0, 1]
    assert _strip_times(r_res) == _strip_times(r_loc)
    assert s_res["after"] == s_loc["after"] and s_res["before"] == s_loc["before"]
    free_cpus_back()


def test_killed_trainer_actor_is_clear_error(cluster, cache, monkeypatch):
    """SIGKILL agent qwen3's trainer actor during a run: train raises promptly, naming the
    agent and pointing to --resume; the run then resumes from its last checkpoint."""
    groups = capture_instances(monkeypatch, ray_trainer.RayAgents)
    tmp = cache
    metrics = tmp / "killed" / "metrics.jsonl"
    th, out = run_in_thread(lambda: _run(tmp, "killed", steps=40, trainer_backend="ray"))
    wait_for_first_step(metrics, th, out, 120)
    pid = ray.get(groups[0].actor(1).ready.remote())
    os.kill(pid, signal.SIGKILL)
    th.join(timeout=120)
    assert not th.is_alive()
    err = out.get("err")
    assert isinstance(err, RuntimeError), out
    assert "the trainer actor of agent 'qwen3' died" in str(err)
    assert "--resume" in str(err)
    free_cpus_back()                        # the run cleaned up its actors
    done = metrics.read_text().count("\n")
    assert 1 <= done < 40
    # what the message promises: --resume continues from the last checkpoint
    monkeypatch.undo()
    _, rows = _run(tmp, "killed", resume=True, steps=done + 1, trainer_backend="ray")
    assert [r["step"] for r in rows] == list(range(done + 1))
    free_cpus_back()


def test_unknown_trainer_backend_is_clear_error():
    with pytest.raises(ValueError, match=r"unknown trainer_backend 'nope'.*local, ray"):
        load_config("tiny3", overrides={"trainer_backend": "nope"})
