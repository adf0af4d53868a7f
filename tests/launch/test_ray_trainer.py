"""Trainer groups as Ray actors (trainer_backend=ray) against a real local Ray cluster
(loopback, private temp dir, 4 logical CPUs; one cluster for the module): a 2-agent run, its
actors updating at once, gives metrics identical to the in-process backend (also with the Ray
rollout pool, and across a resume) on runs whose learners train on each other's samples, and a
killed trainer actor is a clear error naming its agent."""
import json
import os
import signal
import time

import pytest

from hacpo.engine.run_config import load_config
from hacpo.engine.trainer import train
from hacpo.launch import ray_trainer

from ._launch_helpers import (assert_trained_cross, capture_instances, free_cpus_back,
                              run_in_thread, two_agent_cfg, wait_for_first_step)

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
    assert_trained_cross(r_ray, ("char", "qwen3"))   # the equality covers the cross term
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
    assert_trained_cross(r_res[1:], ("char", "qwen3"))   # the resumed step too
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


def _user_length_reward(response: str, gold: str) -> float:
    """A user's reward, registered in the driver's process only (not at this module's import:
    a Ray actor that imports the module must still not know it by name)."""
    return (len(response) % 5) / 4.0


def test_a_users_reward_scores_the_held_out_set_in_the_trainer_actors(cluster, cache):
    """The Ray trainer actors evaluated with a RewardComputer of the run's reward name from
    their own registry: a user's reward (registered in the driver) was "unknown reward" there,
    after the warm-up; a user's override of "math" would have been the built-in one. They get
    the driver's reward, and score as the in-process trainer does."""
    from hacpo.engine import rewards
    rewards.register_reward("_ray_user_length", in_process=True)(_user_length_reward)
    try:
        over = {"reward.name": "_ray_user_length", "steps": 0}
        want, _ = _run(cache, "user-reward-local", **over)
        got, _ = _run(cache, "user-reward-ray", trainer_backend="ray", **over)
    finally:
        rewards._REGISTRY.pop("_ray_user_length", None)
    assert got["before"] == want["before"] and got["after"] == want["after"]
    assert any(r["accuracy"] not in (0.0, 1.0) for r in want["before"].values())
    free_cpus_back()


def test_unknown_trainer_backend_is_clear_error():
    with pytest.raises(ValueError, match=r"unknown trainer_backend 'nope'.*local, ray"):
        load_config("tiny3", overrides={"trainer_backend": "nope"})


def test_update_all_counts_streaks_in_agent_order_before_later_failures():
    """RayAgents.update_all (no cluster: stand-in actors): agent 0's trace takes the run's
    non-finite streak to max_nonfinite while agent 1's actor fails; as one agent after another
    (agent 1 would never have run) the run raises agent 0's NonFiniteUpdateError, not agent 1's
    failure. Without that, agent 1's error is raised and its results are still in order."""
    import types as _types

    import torch

    from hacpo.engine.pool import LearnerView
    from hacpo.engine.timing import Stopwatch
    from hacpo.engine.update import NonFiniteUpdateError

    nan = {"finite": False, "loss": float("nan"), "grad_norm": float("nan")}
    ok = {"finite": True, "loss": 0.5, "grad_norm": 1.0}

    def agents(trace0):
        class Call:
            def __init__(self, k):
                self.remote = lambda *a: k

        ra = ray_trainer.RayAgents.__new__(ray_trainer.RayAgents)
        ra.cfg = _types.SimpleNamespace(max_nonfinite=3, algorithm=load_config(
            "tiny3").algorithm)
        ra.names = ["a", "b"]
        ra._actors = [_types.SimpleNamespace(update_drawn=Call(k)) for k in range(2)]

        def get(k, ref):
            if k == 1:
                raise RuntimeError("the trainer actor of agent 'b' died")
            return {"m": 1.0}, trace0, None, {}, (0.0, 1.0)
        ra._get = get
        return ra

    view = LearnerView(torch.arange(2), torch.ones(2), torch.ones(2),
                       torch.tensor([True, False]), [[1], [1]], [[2], [3]], {})
    pool = _types.SimpleNamespace(prompt=torch.tensor([0, 0]), lp_old=torch.zeros(2),
                                  old_token_logp=[])
    kw = dict(generator=torch.Generator().manual_seed(0), ratio_logs=[None, None],
              sw=Stopwatch(), timer=lambda k: Stopwatch()("x"))
    nonfinite = {"streak": 1, "total": 1}          # an earlier agent's streak, in the run
    with pytest.raises(NonFiniteUpdateError, match="3 non-finite updates in a row for "
                                                   "policy 'a'"):
        agents([nan, nan]).update_all([view, view], pool, nonfinite=nonfinite, **kw)
    assert nonfinite == {"streak": 3, "total": 3, "agents": {"a": 2}}
    with pytest.raises(RuntimeError, match="agent 'b' died"):
        agents([ok, nan]).update_all([view, view], pool,
                                     nonfinite={"streak": 1, "total": 1}, **kw)


def test_trainer_actor_killed_between_calls_is_not_restarted(cluster, tmp_path):
    """SIGKILL agent char-b's trainer actor while it is idle (between two calls): its next call
    is the clear error naming the agent. A restarted actor would answer, from the weights it
    was created with, every step trained since silently lost (actors are made with
    max_restarts=0). Two char agents: their policies need no corpus."""
    import dataclasses

    from hacpo.models.policy import build_policy

    from ._launch_helpers import gone_within

    cfg = two_agent_cfg(tmp_path, "idle", trainer_backend="ray")
    a = cfg.agents[0]
    b = dataclasses.replace(a, policy=dataclasses.replace(a.policy, name="char-b", seed=7))
    cfg = dataclasses.replace(cfg, agents=[a, b])
    ra = ray_trainer.RayAgents(cfg, [build_policy(x.policy) for x in cfg.agents])
    try:
        pid = ray.get(ra.actor(1).ready.remote())
        os.kill(pid, signal.SIGKILL)
        assert gone_within(pid, 10)
        # until Ray has decided the actor's fate (a call right after the kill can fail as
        # "unavailable" also when it would be restarted): dead for good, or never answering
        deadline = time.time() + 60
        while True:
            with pytest.raises(RuntimeError, match=r"the trainer actor of agent 'char-b' "
                                                   r"died.*--resume") as e:
                ra.state_dict(1)
            if "ActorDiedError" in str(e.value) or time.time() > deadline:
                break
            time.sleep(1)
        assert "model" in ra.state_dict(0)        # the other agent's actor still answers
    finally:
        ra.close()
    free_cpus_back()
