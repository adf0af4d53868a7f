"""hacpo.engine.rollout.generate_agents / sync_agents: a step's rollouts of every agent, and
every agent's new weights to its engines, at once with engines whose agents have workers of
their own (the Ray and vLLM pools), one agent after another otherwise. (The real pools:
tests/launch/test_ray_rollout.py, tests/vllm/.)"""
import threading
import time

import pytest

from hacpo.engine.rollout import generate_agents, sync_agents
from hacpo.engine.timing import Stopwatch


class SlowEngine:
    """Agent k's generate takes 0.3 s; records when each call started and ended. With
    ``meet``, every call first waits (up to 30 s) until all 3 agents' calls are running: it
    passes only if they run at once."""

    def __init__(self, concurrent: bool, fail: set[int] = frozenset(), meet: bool = False):
        self.concurrent_agents = concurrent
        self.fail = fail
        self.spans: dict[int, tuple[float, float]] = {}
        self.threads: set[int] = set()
        self.barrier = threading.Barrier(3, timeout=30) if meet else None

    def generate(self, agent, prompt_ids, *, num_samples, max_new_tokens, temperature, top_p):
        t0 = time.monotonic()
        self.threads.add(threading.get_ident())
        if self.barrier is not None:
            self.barrier.wait()
        time.sleep(0.3)
        self.spans[agent] = (t0, time.monotonic())
        if agent in self.fail:
            raise RuntimeError(f"agent {agent} failed")
        return (agent, prompt_ids, num_samples, max_new_tokens, temperature, top_p)


KW = dict(num_samples=2, max_new_tokens=5, temperature=1.0, top_p=0.9)
PROMPTS = [[[1, 2]], [[3]], [[4, 5, 6]]]


def test_pool_engines_sample_all_agents_at_once():
    engine, sw = SlowEngine(True, meet=True), Stopwatch()
    got = generate_agents(engine, PROMPTS, timer=lambda k: sw(f"time/generate/{k}"), **KW)
    assert got == [(k, PROMPTS[k], 2, 5, 1.0, 0.9) for k in range(3)]    # agent order
    # the 3 calls met at the barrier: they ran at once, from 3 threads
    assert len(engine.threads) == 3
    assert all(sw[f"time/generate/{k}"] >= 0.3 for k in range(3))   # each its own wall time


def test_in_process_engines_sample_one_agent_after_another():
    engine, sw = SlowEngine(False), Stopwatch()
    got = generate_agents(engine, PROMPTS, timer=lambda k: sw(f"time/generate/{k}"), **KW)
    assert [g[0] for g in got] == [0, 1, 2] and len(engine.threads) == 1
    spans = [engine.spans[k] for k in range(3)]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))        # no overlap


def test_pool_engines_sample_and_sync_one_agent_after_another_without_at_once():
    """agents_at_once=false: a pool engine's agents sample, and get their weights, one after
    another from the calling thread, as an in-process engine's do."""
    engine = SlowEngine(True)
    got = generate_agents(engine, PROMPTS, timer=lambda k: Stopwatch()("x"), at_once=False,
                          **KW)
    assert [g[0] for g in got] == [0, 1, 2] and len(engine.threads) == 1
    spans = [engine.spans[k] for k in range(3)]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))        # no overlap
    log = SyncLog(True)
    sync_agents(log, log, 3, timer=lambda k: Stopwatch()("x"), at_once=False)
    assert [(w, k) for w, k, _ in log.calls] == [
        (w, k) for k in range(3) for w in ("pull", "sync-start", "sync")]
    assert len({t for _, _, t in log.calls}) == 1


def test_an_agents_error_is_raised_after_all_calls_ended():
    engine = SlowEngine(True, fail={1, 2}, meet=True)
    with pytest.raises(RuntimeError, match="agent 1 failed"):        # the first, in order
        generate_agents(engine, PROMPTS, timer=lambda k: Stopwatch()("x"), **KW)
    assert set(engine.spans) == {0, 1, 2}                 # every call had ended


class SyncLog:
    """Agents (pull_weights) and engine (sync_weights) of a sync: records (call, agent, thread)
    in order under a lock. With ``meet`` every sync_weights first waits (up to 30 s) until all 3
    agents' syncs are running, so it passes only if they run at once; a pull sleeps 0.1 s so a
    sync that did not wait for its own agent's pull would be seen."""

    def __init__(self, concurrent: bool, meet: bool = False, fail: set[int] = frozenset()):
        self.concurrent_agents = concurrent
        self.calls: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(3, timeout=30) if meet else None
        self.fail = fail

    def _log(self, what, k):
        with self.lock:
            self.calls.append((what, k, threading.get_ident()))

    def pull_weights(self, k):
        time.sleep(0.1)
        self._log("pull", k)

    def sync_weights(self, k):
        self._log("sync-start", k)
        if self.barrier is not None:
            self.barrier.wait()
        if k in self.fail:
            raise RuntimeError(f"agent {k} sync failed")
        self._log("sync", k)


def _of(log, k):
    return [w for w, a, _ in log.calls if a == k]


def test_pool_engines_sync_all_agents_at_once():
    log, sw = SyncLog(True, meet=True), Stopwatch()
    sync_agents(log, log, 3, timer=lambda k: sw(f"time/sync/{k}"))
    for k in range(3):                      # each agent: its pull, then its engines' load
        assert _of(log, k) == ["pull", "sync-start", "sync"]
        assert sw[f"time/sync/{k}"] >= 0.1
    assert len({t for _, _, t in log.calls}) == 3      # met at the barrier, from 3 threads


def test_in_process_engines_sync_one_agent_after_another():
    log = SyncLog(False)
    sync_agents(log, log, 3, timer=lambda k: Stopwatch()("x"))
    assert [(w, k) for w, k, _ in log.calls] == [
        (w, k) for k in range(3) for w in ("pull", "sync-start", "sync")]
    assert len({t for _, _, t in log.calls}) == 1


def test_start_up_sync_does_not_pull():
    log = SyncLog(True, meet=True)
    sync_agents(log, log, 3, timer=lambda k: Stopwatch()("x"), pull=False)
    assert sorted((w, k) for w, k, _ in log.calls if w != "sync-start") == [
        ("sync", 0), ("sync", 1), ("sync", 2)]


def test_a_failed_sync_is_raised_after_all_agents_ended():
    log = SyncLog(True, meet=True, fail={2, 1})
    with pytest.raises(RuntimeError, match="agent 1 sync failed"):   # the first, in order
        sync_agents(log, log, 3, timer=lambda k: Stopwatch()("x"))
    assert [w for w, k, _ in log.calls if k == 0] == ["pull", "sync-start", "sync"]


class Publishing:
    """Agents whose trainer can put its weights into the object store itself (megatron:
    publish_weights; None for an agent that cannot, e.g. trainer=torch), and an engine that
    loads such refs (vLLM: sync_published) or syncs from the driver's policy."""

    def __init__(self, can_publish=(True, False)):
        self.can = can_publish
        self.calls: list[tuple[str, int]] = []
        self.concurrent_agents = False

    def publish_weights(self, k):
        self.calls.append(("publish", k))
        return [f"ref{k}"] if self.can[k] else None

    def pull_weights(self, k):
        self.calls.append(("pull", k))

    def sync_published(self, k, refs):
        assert refs == [f"ref{k}"]
        self.calls.append(("sync_published", k))

    def sync_weights(self, k):
        self.calls.append(("sync", k))


def test_published_weights_skip_the_driver_where_both_sides_can():
    p = Publishing()
    sync_agents(p, p, 2, timer=lambda k: Stopwatch()("x"))
    assert p.calls == [("publish", 0), ("sync_published", 0),      # trainer -> engines
                       ("publish", 1), ("pull", 1), ("sync", 1)]     # cannot: via the driver
    p.calls.clear()
    sync_agents(p, p, 2, timer=lambda k: Stopwatch()("x"), pull=False)   # start-up
    assert p.calls == [("sync", 0), ("sync", 1)]

    class DriverEngine:              # an engine that reads the driver's policy (local, Ray)
        concurrent_agents = False

        def sync_weights(self, k):
            q.calls.append(("sync", k))
    q = Publishing()
    sync_agents(q, DriverEngine(), 2, timer=lambda k: Stopwatch()("x"))
    assert q.calls == [("pull", 0), ("sync", 0), ("pull", 1), ("sync", 1)]


def test_generator_state_of_another_agent_count_is_an_error():
    """zip() used to restore only the common agents' sampling RNGs and leave the rest as they
    were, silently (e.g. a checkpoint of 2 agents into a 3-agent engine)."""
    import torch

    from hacpo.engine.rollout import LocalRolloutEngine

    two, three = LocalRolloutEngine([None, None], seed=1), LocalRolloutEngine([None] * 3, seed=2)
    before = [g.get_state() for g in three.generators]
    with pytest.raises(ValueError, match="holds 2 agents' generator states, this engine has 3"):
        three.load_state_dict(two.state_dict())
    assert all(torch.equal(a, g.get_state()) for a, g in zip(before, three.generators))
    with pytest.raises(ValueError, match="holds 3 agents' generator states, this engine has 2"):
        two.load_state_dict(three.state_dict())
    three.load_state_dict(LocalRolloutEngine([None] * 3, seed=1).state_dict())     # same count
    assert torch.equal(three.generators[2].get_state(),
                       LocalRolloutEngine([None] * 3, seed=1).generators[2].get_state())
