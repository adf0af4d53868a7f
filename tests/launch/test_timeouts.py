"""Hung (alive, never answering) workers and waits get a time limit, against real Ray (one
private local cluster for the module) and a real `hacpo launch local`:

- the shared wait (``ray_cluster.next_ready``): results before deadlines, a late call named;
- a Ray rollout actor that hangs mid-call (result computed, then asleep) or is frozen
  (SIGSTOP) during a weight sync: killed, restarted, the call re-sent; the results equal the
  no-fault run's bit for bit and the timeouts are counted; past max_engine_restarts a clear
  error naming agent, actor, timeout and config key;
- a frozen trainer actor: a clear error within trainer_call_timeout_s, the actor killed;
- ``hacpo launch local --wait-timeout``: exit 124 with a message, nothing left running.
"""
import os
import re
import signal
import time
from pathlib import Path

import pytest

from hacpo.engine import build
from hacpo.engine.run_config import fingerprint_dict, load_config
from hacpo.engine.trainer import train
from hacpo.launch import ray_trainer
from hacpo.launch.cli import main
from hacpo.launch.ray_cluster import call_deadline, next_ready
from hacpo.launch.ray_rollout import RayRolloutEngine

from ._launch_helpers import (alive, capture_instances, free_cpus_back, gone_within, hacpo,
                              perturb_weights, processes_mentioning, reap, run_in_thread,
                              tiny_run_args, two_agent_cfg, wait_for_first_step)

import ray

GEN = dict(num_samples=3, max_new_tokens=12, temperature=1.0, top_p=0.9)


# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------
def test_timeout_config_is_checked_and_resumable():
    with pytest.raises(ValueError,
                       match=r"rollout.call_timeout_s must be a finite number >= 0 .*got -1"):
        load_config("tiny3", overrides={"rollout.call_timeout_s": -1})
    with pytest.raises(ValueError,
                       match=r"trainer_call_timeout_s must be a finite number >= 0 .*got nan"):
        load_config("tiny3", overrides={"trainer_call_timeout_s": "nan"})
    cfg = load_config("tiny3")
    assert cfg.rollout.call_timeout_s == 1800 and cfg.trainer_call_timeout_s == 3600
    # a run that timed out, or used up its engine restarts, may resume with other limits:
    # they are no part of the math (a restarted engine re-sends the call with the same seeds)
    other = cfg.override({"rollout.call_timeout_s": 0, "trainer_call_timeout_s": 5,
                          "rollout.max_engine_restarts": 9})
    assert fingerprint_dict(other) == fingerprint_dict(cfg)
    assert fingerprint_dict(cfg.override({"rollout.engines_per_agent": 2})) != \
        fingerprint_dict(cfg)


# --------------------------------------------------------------------------------------------
# the shared wait
# --------------------------------------------------------------------------------------------
class Sleeper:
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def test_next_ready_takes_results_first_and_names_a_late_call(cluster):
    a, b = [ray.remote(Sleeper).options(num_cpus=0).remote() for _ in range(2)]
    ray.get([a.sleep.remote(0), b.sleep.remote(0)])           # both started
    fast, slow = a.sleep.remote(0.2), b.sleep.remote(30)
    t0 = time.monotonic()
    deadlines = {fast: call_deadline(10), slow: call_deadline(3)}
    assert next_ready([fast, slow], deadlines) == (fast, False)
    assert next_ready([slow], deadlines) == (slow, True)       # at its deadline, not at 30 s
    assert 2.9 < time.monotonic() - t0 < 30
    # a ready result wins over its passed deadline; no deadline (0 s limit) waits
    done = a.sleep.remote(0)
    ray.wait([done])
    assert call_deadline(0) is None
    assert next_ready([done], {done: time.monotonic() - 1}) == (done, False)
    late = a.sleep.remote(0.5)
    assert next_ready([late], {late: None}) == (late, False)
    for x in (a, b):
        ray.kill(x, no_restart=True)


# --------------------------------------------------------------------------------------------
# a hung Ray rollout actor
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(cluster, tmp_path_factory):
    cfg = two_agent_cfg(tmp_path_factory.mktemp("timeouts"))
    data = build.load_data(cfg)
    pol = build.build_policies(cfg, data)[1]     # qwen3 (reduced BPE); sets 1 torch thread
    return cfg, pol, [pol.tokenizer.prompt_ids(build.prompt_text(cfg, e))
                      for e in data.train[:5]]


def test_hung_rollout_actor_is_restarted_and_the_call_retried(setup, tmp_path):
    """Two actors for one agent, rollout.call_timeout_s=6, max_engine_restarts=2.
    1. actor 1 computes its result, then sleeps 600 s: after 6 s it is killed, Ray restarts
       it, the same request is re-sent, and the Rollout equals the no-fault run's;
    2. actor 1 frozen (SIGSTOP) during a weight sync: killed, restarted, synced; the next
       generate equals the no-fault run's (so the new weights were loaded);
    3. a third hang exhausts the budget: a clear error naming agent, actor, timeout, keys."""
    cfg, pol, prompts = setup
    cfg = cfg.override({"rollout.engines_per_agent": 2, "rollout.max_engine_restarts": 2,
                        "rollout.call_timeout_s": 6})
    frozen = []
    eng = RayRolloutEngine([pol], cfg)
    try:
        eng.sync_weights(0)
        actor = eng.actors(0)[1]
        marker = tmp_path / "pause.pid"

        state = eng.state_dict()
        want = eng.generate(0, prompts, **GEN)              # the no-fault run
        eng.load_state_dict(state)
        ray.get(actor.debug_pause_next_generate.remote(600.0, str(marker)))
        t0 = time.time()
        got = eng.generate(0, prompts, **GEN)
        took = time.time() - t0
        assert got == want
        assert 6 <= took < 6 + 120, took                    # waited 6 s, not 600
        hung_pid = int(marker.read_text())
        assert gone_within(hung_pid, 10), "the hung actor process was not killed"
        st = eng.stats()
        assert st["timeouts"] == 1 and st["timeouts_per_actor"] == {pol.name: [0, 1]}
        assert st["restarts"] == 1 and st["restarts_per_actor"] == {pol.name: [0, 1]}
        assert st["retried_calls"] == 1

        # 2. frozen during sync_weights: new weights, next generate = no-fault reference
        pid = ray.get(actor.ready.remote())
        assert pid != hung_pid
        perturb_weights(pol, 5)
        os.kill(pid, signal.SIGSTOP)
        frozen.append(pid)
        eng.sync_weights(0)
        assert gone_within(pid, 10)
        st = eng.stats()
        assert st["timeouts_per_actor"] == {pol.name: [0, 2]}
        assert st["restarts_per_actor"] == {pol.name: [0, 2]}
        state = eng.state_dict()
        got = eng.generate(0, prompts, **GEN)
        ref = RayRolloutEngine([pol], cfg.override({"rollout.call_timeout_s": 0}))
        try:                                                 # fault-free pool, same weights
            ref.sync_weights(0)
            ref.load_state_dict(state)
            assert ref.generate(0, prompts, **GEN) == got
        finally:
            ref.close()

        # 3. budget exhausted: a clear error, the hung process killed
        marker.unlink()
        ray.get(actor.debug_pause_next_generate.remote(600.0, str(marker)))
        t0 = time.time()
        with pytest.raises(RuntimeError) as e:
            eng.generate(0, prompts, **GEN)
        assert time.time() - t0 < 6 + 90
        msg = str(e.value)
        assert f"rollout actor 1 of agent '{pol.name}' did not answer a generate call within " \
               f"rollout.call_timeout_s=6 s" in msg, msg
        assert "rollout.max_engine_restarts=2 is exhausted" in msg, msg
        assert gone_within(int(marker.read_text()), 10)
        assert eng.stats()["timeouts"] == 3
    finally:
        eng.close()
        reap(frozen)
    free_cpus_back()


# --------------------------------------------------------------------------------------------
# a hung trainer actor
# --------------------------------------------------------------------------------------------
def test_hung_trainer_actor_is_a_clear_error(cluster, tmp_path, monkeypatch):
    """Freeze (SIGSTOP) agent qwen3's trainer actor during a run with
    trainer_call_timeout_s=15: train raises within the limit (not a hang), naming the agent,
    the timeout and --resume; the frozen actor is killed."""
    groups = capture_instances(monkeypatch, ray_trainer.RayAgents)
    metrics = tmp_path / "hung" / "metrics.jsonl"
    th, out = run_in_thread(lambda: train(two_agent_cfg(
        tmp_path, "hung", steps=40, trainer_backend="ray", trainer_call_timeout_s=15),
        echo=lambda *_: None))
    pid = None
    try:
        wait_for_first_step(metrics, th, out, 120)
        pid = ray.get(groups[0].actor(1).ready.remote())
        os.kill(pid, signal.SIGSTOP)
        t_stop = time.time()
        th.join(timeout=120)
        assert not th.is_alive()
        took = time.time() - t_stop
        err = out.get("err")
        assert isinstance(err, RuntimeError), out
        assert "the trainer actor of agent 'qwen3' did not answer a call within " \
               "trainer_call_timeout_s=15 s" in str(err), err
        assert "was killed" in str(err) and "--resume" in str(err)
        assert took < 15 + 120, took         # the limit, the kill and the run's cleanup
        assert gone_within(pid, 10), "the hung trainer actor was not killed"
        assert metrics.read_text().count("\n") < 40
    finally:
        if pid is not None:
            reap([pid])
    free_cpus_back()


# --------------------------------------------------------------------------------------------
# hacpo launch local --wait-timeout
# --------------------------------------------------------------------------------------------
def test_launch_local_wait_timeout_ends_everything(tmp_path):
    """A run far longer than --wait-timeout 40: the driver's process group and the Ray
    processes are ended, exit 124, the message names the driver's process group, the elapsed
    time and the logs; nothing is left running."""
    out = tmp_path / "run"
    args = tiny_run_args(out, tmp_path)
    args[args.index("steps=2")] = "steps=1000"
    t0 = time.time()
    r = hacpo(["launch", "local", "--cpus-per-node", "3", "--wait-timeout", "40", *args],
              timeout=300)
    took = time.time() - t0
    assert r.returncode == 124, r.stdout[-3000:] + r.stderr[-3000:]
    assert "driver:" in r.stdout          # the driver ran and was ended
    m = re.search(r"hacpo launch: error: the local launch did not finish within --wait-timeout "
                  r"40s \(the driver was still running; (\d+)s elapsed\): killed the driver's "
                  r"process group (\d+) and stopped the Ray cluster; Ray logs: (\S+)/, run dir: "
                  r"(\S+)", r.stderr)
    assert m, r.stderr[-3000:]
    assert 40 <= int(m.group(1)) < 40 + 45
    assert Path(m.group(3)) == out / "launch-local" and Path(m.group(4)) == out
    assert took < 40 + 150, took
    assert not alive(int(m.group(2)))
    tmp = re.search(r"temp dir (\S+),", r.stdout).group(1)
    assert not Path(tmp).exists()
    assert not processes_mentioning(tmp), "Ray processes left running"
    assert not processes_mentioning(str(out)), "driver processes left running"


def test_launch_wait_timeout_must_be_positive(tmp_path, capsys):
    for launcher in (["local"], ["slurm", "--nodes", "1", "--wait"]):
        rc = main(["launch", *launcher, "--wait-timeout", "0",
                   *tiny_run_args(tmp_path / "r", tmp_path)])
        err = capsys.readouterr().err
        assert rc == 2 and "--wait-timeout must be > 0 seconds, got 0" in err, err
    assert not (tmp_path / "r").exists()
