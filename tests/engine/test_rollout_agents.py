"""hacpo.engine.rollout.generate_agents: a step's rollouts of every agent, sampled at once by
engines whose agents have workers of their own (the Ray and vLLM pools), one after another
otherwise. (The real pools: tests/launch/test_ray_rollout.py, tests/vllm/.)"""
import threading
import time

import pytest

from hacpo.engine.rollout import generate_agents
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


def test_an_agents_error_is_raised_after_all_calls_ended():
    engine = SlowEngine(True, fail={1, 2}, meet=True)
    with pytest.raises(RuntimeError, match="agent 1 failed"):        # the first, in order
        generate_agents(engine, PROMPTS, timer=lambda k: Stopwatch()("x"), **KW)
    assert set(engine.spans) == {0, 1, 2}                 # every call had ended
