"""RayRolloutEngine's restart budget and answer checks against stand-in rollout actors in the
module's private Ray cluster (no policy, a few seconds each): a death in a call at the budget is
still retried and one past it is the error; restarts while idle (a new pid) count against the
same budget; only the dead actor's shard is re-sent; an actor answering with weights of another
version is an error, never a sample.

A stand-in's fault plan lives in a separate actor, so that Ray's restart of a stand-in (same
constructor arguments) goes on with the plan instead of starting it over. Every generate call
is logged (before its fault) so that the tests count what was sent to whom.
"""
import os
import signal
import uuid

import pytest
import torch

from hacpo.engine.rollout import agent_generators
from hacpo.launch.ray_rollout import RayRolloutEngine
from hacpo.models.generation import Rollout

import ray

GEN = dict(num_samples=2, max_new_tokens=4, temperature=1.0, top_p=1.0)
PROMPTS = [[10 + i, 5] for i in range(5)]           # prompt i starts with id 10 + i


class _Plan:
    """Per actor tag: the faults of its successive generate calls, the pid it reports (a
    changed pid is how a restart while idle shows), and the log of calls (tag, prompt ids)."""

    def __init__(self, faults):
        self.faults, self.pids, self.calls = {t: list(f) for t, f in faults.items()}, {}, []

    def next(self, tag, prompts):
        self.calls.append((tag, [p[0] for p in prompts]))
        f = self.faults.get(tag)
        return (f.pop(0) if f else None), self.pids.get(tag)

    def set_pid(self, tag, pid):
        self.pids[tag] = pid

    def get_calls(self):
        return self.calls


class _Actor:
    """Stands in for RolloutActor.generate: samples drawn from the request's RNG state (so a
    re-sent request gives the same samples), each response starting with its prompt's first
    id; it reports its pid unless the plan names another. Faults: "die" (SIGKILLed in the
    call, as test_ray_rollout.py kills a real one; Ray restarts it), "wrong_version" (answers
    as if it held weights version 99). The plan is found by name (an actor handle as a
    constructor argument would be an argument in the object store of a restartable actor)."""

    def __init__(self, plan_name, tag):
        self.plan, self.tag = ray.get_actor(plan_name), tag

    def ready(self, policy=None):
        return os.getpid()

    def generate(self, weights, prompt_ids, rng_state, kwargs, policy=None):
        fault, pid = ray.get(self.plan.next.remote(self.tag, prompt_ids))
        if fault == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        (version, _), = weights
        gen = torch.Generator()
        gen.set_state(rng_state)
        G = kwargs["num_samples"]
        resp = [[p[0]] + torch.randint(20, 60, (3,), generator=gen).tolist()
                for p in prompt_ids for _ in range(G)]
        ro = Rollout(policy_name="fake", prompt_ids=prompt_ids,
                     prompt_index=[i for i in range(len(prompt_ids)) for _ in range(G)],
                     response_ids=resp, sampler_logprobs=[[-1.0] * 4 for _ in resp],
                     finished_eos=[False] * len(resp), truncated=[True] * len(resp))
        return ro, gen.get_state(), pid or os.getpid(), 99 if fault == "wrong_version" else version


class Pool:
    """A RayRolloutEngine of one agent over ``engines`` stand-ins (Ray max_restarts as the
    pool sets it)."""

    def __init__(self, engines, *, max_restarts, faults=None):
        name = f"plan-{uuid.uuid4().hex}"
        self.plan = ray.remote(_Plan).options(num_cpus=0, name=name).remote(faults or {})
        pool = self.pool = RayRolloutEngine.__new__(RayRolloutEngine)
        pool.names, pool.engines_per_agent, pool.max_restarts = ["fake"], engines, max_restarts
        pool.generators = agent_generators(0, 1)
        pool._actors = [[ray.remote(_Actor).options(
            num_cpus=0, max_restarts=max_restarts, max_task_retries=0).remote(name, str(j))
            for j in range(engines)]]
        pool._weights, pool._policy_refs = [(3, [])], [[None]]
        pool._restarts, pool._timeouts = [[0] * engines], [[0] * engines]
        pool.call_timeout_s, pool.start_timeout_s = 0, 60
        pool._retried_calls, pool._closed = [0], False
        pool._pids = [ray.get([a.ready.remote() for a in pool._actors[0]])]   # as started

    def calls(self):
        return ray.get(self.plan.get_calls.remote())

    def close(self):
        for a in self.pool._actors[0] + [self.plan]:
            ray.kill(a, no_restart=True)


def _fault_free(engines):
    p = Pool(engines, max_restarts=0)
    try:
        return [p.pool.generate(0, PROMPTS, **GEN) for _ in range(2)]
    finally:
        p.close()


def test_death_at_the_budget_is_retried_and_one_past_it_is_the_error(cluster):
    """max_engine_restarts=1, two actors: actor 1 dies in the first call (its restart 1 of 1):
    only its shard is re-sent, the rollout is the fault-free one; it dies again in the next
    call: the error names the agent, the actor and the budget."""
    want, _ = _fault_free(2)
    p = Pool(2, max_restarts=1, faults={"1": ["die", None, "die"]})
    try:
        got = p.pool.generate(0, PROMPTS, **GEN)
        assert got == want
        assert got.response_ids[::2] and all(r[0] == 10 + i for i, r in
                                             zip(got.prompt_index, got.response_ids))
        st = p.pool.stats()
        # (Ray reports the death as ActorDiedError, or as ActorUnavailableError while it
        # restarts the actor, then the new pid tells: one restart either way)
        assert st["restarts_per_actor"] == {"fake": [0, 1]} and st["retried_calls"] >= 1
        # prompts 0-2 to actor 0 once; 3-4 to actor 1, then to its restart
        assert sorted(p.calls()) == [("0", [10, 11, 12]), ("1", [13, 14]), ("1", [13, 14])]
        with pytest.raises(RuntimeError, match=r"^rollout actor 1 of agent 'fake' (died|was "
                                               r"restarted) 2 times; "
                                               r"rollout.max_engine_restarts=1 exhausted"):
            p.pool.generate(0, PROMPTS, **GEN)
    finally:
        p.close()


def test_restarts_while_idle_count_against_the_budget(cluster):
    """An actor whose pid changed between calls was restarted while idle: each change is one
    restart; past max_engine_restarts=1 the error names the agent and the actor."""
    p = Pool(1, max_restarts=1)
    try:
        p.pool.generate(0, PROMPTS, **GEN)
        assert p.pool.stats()["restarts"] == 0
        ray.get(p.plan.set_pid.remote("0", 1001))
        p.pool.generate(0, PROMPTS, **GEN)
        assert p.pool.stats()["restarts_per_actor"] == {"fake": [1]}
        p.pool.generate(0, PROMPTS, **GEN)                    # same pid: no restart
        assert p.pool.stats()["restarts"] == 1
        ray.get(p.plan.set_pid.remote("0", 1002))
        with pytest.raises(RuntimeError, match=r"^rollout actor 0 of agent 'fake' was restarted "
                                               r"2 times; rollout.max_engine_restarts=1 "
                                               r"exhausted"):
            p.pool.generate(0, PROMPTS, **GEN)
    finally:
        p.close()


def test_answer_from_another_weights_version_is_an_error(cluster):
    """The pool's weights are version 3; an actor answering with version 99 is an error
    naming it and both versions, and the agent's RNG does not advance."""
    p = Pool(2, max_restarts=1, faults={"0": ["wrong_version"]})
    try:
        before = p.pool.generators[0].get_state()
        with pytest.raises(RuntimeError, match=r"^rollout actor 0 of agent 'fake' sampled with "
                                               r"weights version 99, expected 3$"):
            p.pool.generate(0, PROMPTS, **GEN)
        assert torch.equal(p.pool.generators[0].get_state(), before)
    finally:
        p.close()


def test_restart_budget_boundaries(cluster):
    """The bookkeeping behind every path, at its boundary (max_engine_restarts=2): a death in
    a call, a restart while idle and a hung call each count one restart of the actor, the
    second restart is still within the budget, the third is the error."""
    p = Pool(2, max_restarts=2)
    try:
        pool, err = p.pool, ConnectionError("gone")
        pool._died(0, 1, err)
        pool._died(0, 1, err)                                 # 2 of 2: still retried
        assert pool._restarts == [[0, 2]] and pool._pids[0][1] is None
        with pytest.raises(RuntimeError, match=r"^rollout actor 1 of agent 'fake' died 3 times; "
                                               r"rollout.max_engine_restarts=2 exhausted \(last "
                                               r"error: ConnectionError: gone\)$"):
            pool._died(0, 1, err)
        pid = pool._pids[0][0]
        pool._seen_pid(0, 0, pid)                             # same pid: nothing
        pool._seen_pid(0, 0, pid + 1)
        pool._seen_pid(0, 0, pid + 2)                         # 2 of 2
        assert pool._restarts[0][0] == 2 and pool._pids[0][0] == pid + 2
        with pytest.raises(RuntimeError, match=r"^rollout actor 0 of agent 'fake' was restarted "
                                               r"3 times; rollout.max_engine_restarts=2 "
                                               r"exhausted$"):
            pool._seen_pid(0, 0, pid + 3)
        pool._restarts = [[0, 0]]
        pool.call_timeout_s = 5
        pool._timed_out(0, 0, "generate")
        pool._timed_out(0, 0, "generate")                     # 2 of 2: killed, Ray restarts it
        assert pool._restarts == [[2, 0]] and pool._timeouts == [[2, 0]]
        with pytest.raises(RuntimeError, match=r"^rollout actor 0 of agent 'fake' did not answer "
                                               r"a generate call within rollout.call_timeout_s="
                                               r"5 s and was killed; that is its restart 3 and "
                                               r"rollout.max_engine_restarts=2 is exhausted"):
            pool._timed_out(0, 0, "generate")
        assert pool.stats()["timeouts"] == 3
    finally:
        p.close()
