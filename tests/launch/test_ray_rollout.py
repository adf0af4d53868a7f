"""The Ray rollout pool against a real local Ray cluster (loopback, private temp dir, 4 logical
CPUs; one cluster for the module): bit-for-bit equality with the in-process engine, an actor
killed mid-call, a 2-agent training run, and bad input (unreachable address, too few CPUs)."""
import copy
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from hacpo.engine import build
from hacpo.engine.rollout import LocalRolloutEngine
from hacpo.engine.trainer import train
from hacpo.launch.ray_rollout import RayRolloutEngine, merge_rollouts, shard_bounds
from hacpo.models.generation import generate

from ._launch_helpers import assert_trained_cross, perturb_weights, two_agent_cfg

import ray

GEN = dict(num_samples=3, max_new_tokens=12, temperature=1.0, top_p=0.9)


@pytest.fixture(scope="module")
def setup(cluster, tmp_path_factory):
    cfg = two_agent_cfg(tmp_path_factory.mktemp("ray"))
    data = build.load_data(cfg)
    policies = build.build_policies(cfg, data)      # sets torch threads to cfg.threads (1)
    prompts = [[p.tokenizer.prompt_ids(build.prompt_text(cfg, e)) for e in data.train[:5]]
               for p in policies]
    return cfg, policies, prompts


def _sharded_reference(policy, prompts, gen, shards):
    """What the pool's contract says S > 1 shards produce, computed in-process: one seed per
    shard drawn from the agent's generator, shard j samples its prompt slice with it."""
    bounds = shard_bounds(len(prompts), shards)
    seeds = torch.randint(0, 2 ** 62, (len(bounds),), generator=gen).tolist()
    policy.eval()
    parts = [generate(policy, prompts[a:b], generator=torch.Generator().manual_seed(s), **GEN)
             for (a, b), s in zip(bounds, seeds)]
    return merge_rollouts(parts, policy.name)


BUCKET_MB = 0.01     # 10 KiB: a sync of these tiny policies ships many buckets


def test_ray_equals_local_engine(setup):
    """Same policies, seed, prompts: one actor per agent gives exactly the local engine's
    Rollouts, call after call (RNG state round-trips) and after a weight sync, whose weights
    ship in many small buckets (rollout.weight_bucket_mb) that the actors copy in one at a
    time."""
    cfg, policies, prompts = setup
    local = LocalRolloutEngine(policies, cfg.seed)
    eng = RayRolloutEngine(policies, cfg.override({"rollout.weight_bucket_mb": BUCKET_MB}))
    try:
        assert not eng.cluster.owned         # reused the module's connection
        for k in range(2):
            eng.sync_weights(k)
            # what was shipped: the policy's state dict exactly, in buckets of <= BUCKET_MB
            # (a bigger tensor alone)
            sent = ray.get(eng._weights[k][1])
            assert len(sent) > 3, len(sent)
            assert all(len(b) == 1 or sum(t.numel() * t.element_size() for t in b.values())
                       <= BUCKET_MB * 2 ** 20 for b in sent)
            want_sd = policies[k].state_dict()
            merged = {n: t for b in sent for n, t in b.items()}
            assert merged.keys() == want_sd.keys() and sum(map(len, sent)) == len(want_sd)
            assert all(torch.equal(merged[n], want_sd[n]) for n in want_sd)
        for rnd in range(2):
            if rnd == 1:                      # weights change; the actors must follow
                for k, pol in enumerate(policies):
                    perturb_weights(pol, 10 + k)
                    eng.sync_weights(k)
            for k in range(2):
                for _ in range(2):
                    want = local.generate(k, prompts[k], **GEN)
                    got = eng.generate(k, prompts[k], **GEN)
                    assert got == want, (rnd, k)
                    assert len(got.response_ids) == len(prompts[k]) * GEN["num_samples"]
        sd = eng.state_dict()
        assert all(torch.equal(a, b) for a, b in
                   zip(sd["generators"], local.state_dict()["generators"]))
        # resume: restoring the RNG state reproduces the next call exactly
        want = eng.generate(0, prompts[0], **GEN)
        eng.load_state_dict(sd)
        assert eng.generate(0, prompts[0], **GEN) == want
        assert eng.stats()["restarts"] == 0
    finally:
        eng.close()
    assert ray.is_initialized()              # a reused cluster is left running


def test_actor_weight_load_part_way_claims_no_version(setup):
    """A load whose buckets do not cover the state dict (or do not fit it) is a clear error,
    and the actor then claims no weights version, so the next request reloads (here in this
    process: a RolloutActor instance, not a remote one)."""
    from hacpo.launch.ray_rollout import RolloutActor
    from hacpo.models.buckets import weight_buckets

    cfg, policies, _ = setup
    src, dst = policies[0], copy.deepcopy(policies[0])
    perturb_weights(dst, 5)
    actor = RolloutActor(threads=1, policy=dst)
    refs = [ray.put(b) for b in weight_buckets(src.state_dict(), 10 * 1024)]
    assert len(refs) > 3
    with pytest.raises(RuntimeError, match=r"weights version 3: weights missing: \["):
        actor.load_weights(3, refs[:-1])
    assert actor.version is None
    bad = {**ray.get(refs[0])}
    name = next(iter(bad))
    bad[name] = bad[name][..., :1]
    with pytest.raises(RuntimeError, match=rf"weight '{name}' .* does not fit: the target's is"):
        actor.load_weights(4, [ray.put(bad), *refs[1:]])
    assert actor.version is None
    actor.load_weights(5, refs)
    assert actor.version == 5
    got = actor.policy.state_dict()
    assert all(torch.equal(got[n], t) for n, t in src.state_dict().items())


def _kill_mid_generate(eng, actor, marker, prompts):
    """Run eng.generate in a thread; SIGKILL ``actor`` once it holds its computed result.
    Returns (rollout or None, exception or None, seconds)."""
    if marker.exists():
        marker.unlink()
    ray.get(actor.debug_pause_next_generate.remote(60.0, str(marker)))
    out = {}

    def run():
        try:
            out["ro"] = eng.generate(0, prompts, **GEN)
        except Exception as e:           # handed to the test thread
            out["err"] = e
    th = threading.Thread(target=run)
    t0 = time.time()
    th.start()
    while not marker.exists() or not marker.read_text():
        assert time.time() - t0 < 60 and th.is_alive(), ("actor never reached the pause", out)
        time.sleep(0.02)
    os.kill(int(marker.read_text()), signal.SIGKILL)     # really mid-call
    th.join(timeout=120)
    assert not th.is_alive()
    return out.get("ro"), out.get("err"), time.time() - t0


def test_kill_actor_mid_call_retries_identically(setup, tmp_path):
    """Two actors for one agent; actor 1 is SIGKILLed while it holds a computed result.
    Ray restarts it, the engine re-sends the same request (same RNG state, latest weights),
    and the Rollout equals the unkilled reference; restarts are counted. An actor killed
    while idle is caught up to the latest weights before it samples. Past
    max_engine_restarts it is a clear error naming the agent and actor."""
    cfg, policies, prompts = setup
    cfg = cfg.override({"rollout.engines_per_agent": 2, "rollout.max_engine_restarts": 2})
    pol = policies[1]
    eng = RayRolloutEngine([pol], cfg)
    try:
        perturb_weights(pol, 99)             # the pickled copy is now stale: sync must matter
        eng.sync_weights(0)
        ref_gen = torch.Generator().manual_seed(cfg.seed * 1000 + 17)
        actor = eng.actors(0)[1]
        marker = tmp_path / "pause.pid"

        want = _sharded_reference(pol, prompts[1], ref_gen, 2)
        got, err, seconds = _kill_mid_generate(eng, actor, marker, prompts[1])
        assert err is None and got == want
        assert seconds < 60                  # retried at once, not after the 60 s pause
        assert eng.stats()["restarts"] == 1
        assert eng.stats()["restarts_per_actor"] == {pol.name: [0, 1]}

        # killed while idle: the restarted actor must not sample with the pickled weights
        os.kill(ray.get(actor.ready.remote()), signal.SIGKILL)
        want = _sharded_reference(pol, prompts[1], ref_gen, 2)
        assert eng.generate(0, prompts[1], **GEN) == want
        assert eng.stats()["restarts_per_actor"] == {pol.name: [0, 2]}

        # a third death exceeds max_engine_restarts=2: clear error
        got, err, _ = _kill_mid_generate(eng, actor, marker, prompts[1])
        assert isinstance(err, RuntimeError), (got, err)
        assert f"rollout actor 1 of agent '{pol.name}' died 3 times" in str(err)
        assert "max_engine_restarts=2 exhausted" in str(err)
    finally:
        eng.close()


def _strip_times(rows):
    """Drop wall times and the Ray pool's own counters (checked to be 0 below)."""
    return [{k: v for k, v in r.items()
             if not k.startswith(("time/", "reward_fn/seconds", "rollout/"))} for r in rows]


def test_train_two_agents_ray_equals_local(setup, tmp_path):
    """`train` end to end with rollout.engine=ray (one actor per agent) gives the same
    metrics, step for step, and the same held-out results as rollout.engine=local; a ray run
    stopped after step 1 and resumed (fresh actors, RNG states from the checkpoint) too."""
    runs = {}
    for kind, steps, resume in (("local", 2, False), ("ray", 2, False), ("ray-resumed", 1, False),
                                ("ray-resumed", 2, True)):
        cfg = two_agent_cfg(tmp_path, **{"out_dir": str(tmp_path / kind), "steps": steps,
                                         "rollout.engine": kind.split("-")[0]})
        summary = train(cfg, resume=resume, echo=lambda *_: None)
        rows = [json.loads(l) for l in open(tmp_path / kind / "metrics.jsonl")]
        runs[kind] = (summary, rows)
    (s_loc, r_loc), (s_ray, r_ray) = runs["local"], runs["ray"]
    assert [r["step"] for r in r_ray] == [0, 1]
    assert _strip_times(r_ray) == _strip_times(r_loc)
    assert_trained_cross(r_ray, ("char", "qwen3"))   # each pool's samples reach the other agent
    assert all(r["rollout/restarts"] == 0 and r["rollout/retried_calls"] == 0 for r in r_ray)
    assert all(r["rollout/timeouts"] == 0 for r in r_ray)     # rollout.call_timeout_s: 1800 s
    assert s_ray["after"] == s_loc["after"] and s_ray["before"] == s_loc["before"]
    s_res, r_res = runs["ray-resumed"]
    assert _strip_times(r_res) == _strip_times(r_ray) and s_res["after"] == s_ray["after"]
    assert_trained_cross(r_res[1:], ("char", "qwen3"))   # the resumed step too
    assert ray.is_initialized()


def test_too_many_engines_is_clear_error(setup):
    cfg, policies, _ = setup
    t0 = time.time()
    with pytest.raises(RuntimeError, match=r"needs 6 CPUs .*engines_per_agent=3.* has 4"):
        RayRolloutEngine(policies, cfg.override({"rollout.engines_per_agent": 3}))
    # fits the cluster's total but not what is free: the placement group times out clearly
    holder = RayRolloutEngine(policies, cfg)          # holds 2 of the 4 CPUs
    try:
        with pytest.raises(RuntimeError, match=r"not granted within 3 s .* 2 free CPUs of 4"):
            RayRolloutEngine(policies[:1], cfg.override({"rollout.engines_per_agent": 3}),
                             timeout_s=3)
    finally:
        holder.close()
    assert time.time() - t0 < 60
    deadline = time.time() + 30              # the pending group was removed: CPUs come back
    while ray.available_resources().get("CPU", 0) < 4:
        assert time.time() < deadline, ray.available_resources()
        time.sleep(0.2)


_SUBPROCESS = r"""
import os, socket, sys, time
from hacpo.engine import build
from hacpo.engine.run_config import load_config
from hacpo.launch.ray_rollout import RayRolloutEngine
import dataclasses, ray

cfg = load_config("tiny3", overrides={"threads": 1, "rollout.engine": "ray"})
cfg = dataclasses.replace(cfg, agents=cfg.agents[:1])
pols = build.build_policies(cfg, build.load_data(cfg))
prompt = [pols[0].tokenizer.prompt_ids("What is 1+1?")]

# 1. unreachable address: a clear error, in bounded time
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
t0 = time.time()
try:
    RayRolloutEngine(pols, cfg.override({"rollout.ray_address": f"127.0.0.1:{port}"}),
                     timeout_s=2)
    sys.exit("no error")
except ConnectionError as e:
    assert f"127.0.0.1:{port}" in str(e) and "within 2 s" in str(e), e
    from hacpo.engine.errors import is_user_error
    assert is_user_error(e), "the command line would print a traceback"
assert time.time() - t0 < 15, time.time() - t0
assert not ray.is_initialized()

# 2. join a running cluster by address (what the Slurm job does): leave it running
eng = RayRolloutEngine(pols, cfg.override({"rollout.ray_address": sys.argv[1]}))
assert not eng.cluster.owned and eng.cluster.connected_here
eng.sync_weights(0)
assert eng.generate(0, prompt, num_samples=2, max_new_tokens=4, temperature=1.0,
                    top_p=1.0).num_samples == 2
eng.close()
assert not ray.is_initialized()

# 3. a private cluster of its own: stopped, temp dir removed, at close
eng = RayRolloutEngine(pols, cfg)
assert eng.cluster.owned and eng.cluster.address.startswith("127.0.0.1:")
assert ray.cluster_resources()["CPU"] == max(1, os.cpu_count())   # sized to hold the pool
eng.sync_weights(0)
eng.generate(0, prompt, num_samples=2, max_new_tokens=4, temperature=1.0, top_p=1.0)
tmp = eng.cluster.temp_dir
eng.close()
assert not ray.is_initialized() and not os.path.exists(tmp)
print("OK", tmp)
"""


def test_join_by_address_private_cluster_and_unreachable(cluster, setup):
    """In a fresh driver process: an unreachable address fails fast and clearly; joining the
    module's cluster by address works and leaves it running; a private cluster is stopped."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", _SUBPROCESS, cluster.address], env=env,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # Ray's core worker logs an error (once per driver process, so a fresh driver is needed
    # to see it) for a restartable actor created with arguments in the object store; the
    # pool's actors take none (they fetch their policy from their calls)
    ray_errors = re.findall(r"^\[[^\]]* E \d+ \d+\] .*$", p.stderr, re.M)
    assert not ray_errors, ray_errors
    tmp = p.stdout.split("OK ")[-1].strip()
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert tmp and tmp not in out           # no process of the private cluster is left
    assert ray.cluster_resources().get("CPU") == 4   # the joined cluster still runs
