"""RayRolloutEngine and RolloutActor without a Ray cluster (a mutation audit's tests): the
module's ``ray``, ``connect``, ``RayCluster`` and ``next_ready`` are in-process stand-ins, and
each actor is a RolloutActor in this process behind a stand-in handle. A call runs when it is
sent; what its reference then gives (the value, the actor's death, a hang until it is killed)
is the test's fault plan. ``next_ready`` hands results back last-sent first, so shards answer
out of order. Checked: how the pool is started (bundles, restart budget, each agent's own
policy), shard requests and their RNG states, the merged rollout, the agent's RNG after a call
and on resume, weights reaching every actor, and the fault bookkeeping of every path (death,
restart while idle, transient unavailability, hang and kill) with the errors past the budget.
(tests/launch/test_ray_rollout.py and test_ray_rollout_faults.py cover real actors.)"""
import copy
import dataclasses
import itertools
import os

import pytest
import torch

from hacpo.engine.rollout import LocalRolloutEngine
from hacpo.engine.run_config import load_config
from hacpo.launch import ray_rollout
from hacpo.launch.ray_rollout import RayRolloutEngine, RolloutActor
from hacpo.models.generation import Rollout
from hacpo.models.policy import build_policy

from ._launch_helpers import install_ray_stand_ins, perturb_weights

from ray.exceptions import ActorDiedError, ActorUnavailableError

GEN = dict(num_samples=2, max_new_tokens=5, temperature=1.0, top_p=0.9)
PROMPTS = [[10 + i, 5] for i in range(5)]           # prompt i starts with id 10 + i
_PIDS = itertools.count(1000)


class _Actor(RolloutActor):
    """A RolloutActor with a pid of its own (a restart gives a new one)."""

    def __init__(self, threads, policy=None):
        super().__init__(threads, policy)
        self.pid = next(_PIDS)

    def ready(self, policy=None):
        super().ready(policy)
        return self.pid

    def load_weights(self, version, refs, policy=None):
        super().load_weights(version, refs, policy)
        return self.pid

    def generate(self, weights, prompt_ids, rng_state, kwargs, policy=None):
        ro, state, _, version = super().generate(weights, prompt_ids, rng_state, kwargs, policy)
        return ro, state, self.pid, version


class _Ref:
    """A call's reference: its value, or the error awaiting it raises; ``late``: how many
    times ``next_ready`` reports it past its deadline first."""

    def __init__(self, handle, value=None, err=None, late=0):
        self.handle, self.value, self.err, self.late = handle, value, err, late


class _Handle:
    """Stand-in actor handle. ``faults[method]``: what its successive calls do (None: answer;
    "die": the process dies in the call, Ray restarts it; "unavailable": a transient
    ActorUnavailableError; "hang": no answer until killed; "hang_past_kill": no answer even
    after the kill; "late_answer": answers, but only after its deadline; "wrong_version":
    answers as if it held weights version 99). ``log``: (method, first prompt ids) sent."""

    def __init__(self, threads):
        self.threads, self.actor, self.faults, self.log = threads, _Actor(threads), {}, []

    def restart(self):                  # what Ray does: same constructor arguments, new pid
        self.actor = _Actor(self.threads)

    def __getattr__(self, name):
        handle = self

        class Call:
            @staticmethod
            def remote(*args):
                handle.log.append((name, [p[0] for p in args[1]] if name == "generate"
                                   else None))
                plan = handle.faults.get(name)
                fault = plan.pop(0) if plan else None
                if fault == "die":
                    handle.restart()
                    return _Ref(handle, err=ActorDiedError())
                if fault == "unavailable":
                    return _Ref(handle, err=ActorUnavailableError("restarting", None))
                if fault in ("hang", "hang_past_kill"):
                    return _Ref(handle, err=ActorDiedError(), late=1 + (fault != "hang"))
                value = getattr(handle.actor, name)(*args)
                if fault == "wrong_version":
                    value = (*value[:3], 99)
                return _Ref(handle, value=value, late=int(fault == "late_answer"))
        return Call


class _Remote:
    def __init__(self, made):
        self.made = made

    def options(self, **opts):
        made = self.made

        class Cls:
            @staticmethod
            def remote(threads):
                h = _Handle(threads)
                made.append((h, opts))
                return h
        return Cls


class _Ray:
    """The module's ``ray``: ``put`` gives a reference whose ``get`` is a copy (what an
    actor unpickles); ``kill`` restarts the actor unless ``no_restart``."""

    def __init__(self):
        self.made, self.killed = [], []

    def remote(self, cls):
        assert cls is RolloutActor
        return _Remote(self.made)

    def put(self, x):
        return _Ref(None, value=copy.deepcopy(x))        # a snapshot, as ray.put takes

    def get(self, ref, timeout=None):
        if ref.err is not None:
            raise ref.err
        return copy.deepcopy(ref.value) if ref.handle is None else ref.value

    def kill(self, handle, no_restart):
        self.killed.append((handle, no_restart))
        if not no_restart:
            handle.restart()


def _next_ready(pending, deadlines):
    """Results first, the last sent first; else a late call (one report each)."""
    refs = list(pending)[::-1]
    for r in refs:
        if r.late == 0:
            return r, False
    refs[0].late -= 1
    return refs[0], True


class _Cluster:
    """The module's connection: records what the pool asks of it."""
    address = "stand-in"
    fail_require = False

    def __init__(self, log):
        self.log = log

    def require(self, resource, need, *, what, hint):
        self.log.append(("require", resource, need, what))
        if self.fail_require:
            raise RuntimeError("too small")

    def reserve(self, bundles, *, what, hint, timeout_s):
        self.log.append(("reserve", bundles))
        return f"pg{len([e for e in self.log if e[0] == 'reserve'])}"

    @staticmethod
    def wait_started(ref, *, what, timeout_s):
        return ray_rollout.ray.get(ref)

    def shutdown(self):
        self.log.append(("shutdown",))


@pytest.fixture
def stand_in(monkeypatch):
    """Installs the stand-ins; yields the module's stand-in ``ray``, whose ``log`` has the
    cluster's calls and ``released`` what ``close`` released."""
    threads = torch.get_num_threads()
    yield install_ray_stand_ins(monkeypatch, ray_rollout, _Ray(), _Cluster,
                                next_ready=_next_ready)
    torch.set_num_threads(threads)


def _cfg(**over):
    """tiny3's char agent and a second char agent of another seed (one tokenizer)."""
    cfg = load_config("tiny3", overrides={"threads": 1, "rollout.engine": "ray", **over})
    a = cfg.agents[0]
    b = dataclasses.replace(a, policy=dataclasses.replace(a.policy, name="char-b", seed=7))
    return dataclasses.replace(cfg, agents=[a, b])


@pytest.fixture(scope="module")
def policies():
    return [build_policy(a.policy) for a in _cfg().agents]


def _fake_generate(policy, prompt_ids, *, generator, num_samples, **kw):
    """Stands in for generation: sample g of prompt p is [p[0], policy's tag, 3 draws]."""
    tag = int(policy.name == "char-b")
    resp = [[p[0], tag] + torch.randint(20, 60, (3,), generator=generator).tolist()
            for p in prompt_ids for _ in range(num_samples)]
    n = len(resp)
    return Rollout(policy_name=policy.name, prompt_ids=prompt_ids,
                   prompt_index=[i for i in range(len(prompt_ids)) for _ in range(num_samples)],
                   response_ids=resp, sampler_logprobs=[[-1.0] * 5] * n,
                   finished_eos=[False] * n, truncated=[True] * n)


def _pool(policies, engines=2, **over):
    eng = RayRolloutEngine(policies, _cfg(**{"rollout.engines_per_agent": engines, **over}))
    for k in range(len(policies)):
        eng.sync_weights(k)
    return eng


def _generates(handle):
    """The prompts (first ids) of each generate call sent to ``handle``."""
    return [c[1] for c in handle.log if c[0] == "generate"]


# -- bring-up -------------------------------------------------------------------------------------
def test_pool_start_one_actor_per_bundle_with_its_agents_policy(stand_in, policies):
    """2 agents x 3 actors of 2 threads: the cluster must hold 12 CPUs; one placement group
    per agent of 3 two-CPU bundles, actor j in bundle j, Ray restarts up to
    max_engine_restarts and retries no task (the pool does); each actor holds its own
    agent's policy before it answers ready."""
    eng = RayRolloutEngine(policies, _cfg(**{"rollout.engines_per_agent": 3, "threads": 2,
                                             "rollout.max_engine_restarts": 4}))
    log = stand_in.log
    assert log[0] == ("connect", max(12, os.cpu_count() or 1))     # sized to hold the pool
    assert log[1][:3] == ("require", "CPU", 12)
    assert "needs 12 CPUs (2 agents x rollout.engines_per_agent=3 x 2 CPU each)" in log[1][3]
    assert log[2:] == [("reserve", [{"CPU": 2}] * 3)] * 2
    assert len(stand_in.made) == 6
    for i, (h, opts) in enumerate(stand_in.made):
        assert opts == {"num_cpus": 2, "max_restarts": 4, "max_task_retries": 0,
                        "scheduling_strategy": {"placement_group": f"pg{i // 3 + 1}",
                                                "placement_group_bundle_index": i % 3}}
        assert h.threads == 2 and h.actor.policy.name == policies[i // 3].name
        assert h.actor.policy is not policies[i // 3]           # a copy, as unpickled
    assert eng._pids == [[h.actor.pid for h, _ in stand_in.made[k * 3:k * 3 + 3]]
                         for k in range(2)]
    eng.close()
    eng.close()                                                # idempotent
    assert stand_in.released == [([h for h, _ in stand_in.made], ["pg1", "pg2"])]
    assert log.count(("shutdown",)) == 1


def test_unset_threads_is_one_cpu_per_actor(stand_in, policies):
    """threads=0 (torch's default in-process) gives each actor one thread and one CPU."""
    eng = RayRolloutEngine(policies[:1], _cfg(**{"threads": 0}))
    assert stand_in.made[0][1]["num_cpus"] == 1 and stand_in.made[0][0].threads == 1
    eng.close()


def test_failed_start_releases_the_cluster(stand_in, policies, monkeypatch):
    """A start that fails once connected (here: too few CPUs) closes the pool: a private
    cluster is not left running."""
    monkeypatch.setattr(_Cluster, "fail_require", True)
    with pytest.raises(RuntimeError, match="too small"):
        RayRolloutEngine(policies, _cfg())
    assert stand_in.log[-1] == ("shutdown",)


def test_policy_off_the_cpu_is_a_clear_error(stand_in, policies):
    """The actors sample on CPUs: a policy elsewhere is refused before any cluster is asked."""
    meta = copy.deepcopy(policies[0]).to("meta")
    with pytest.raises(ValueError, match=r"^rollout.engine=ray samples on CPU actors, but "
                                         r"policy 'char' is on meta; use rollout.engine=local"):
        RayRolloutEngine([meta], _cfg())
    assert stand_in.log == []                                  # no cluster was asked


def test_bad_calls_are_clear_errors(stand_in, policies):
    """generate before the agent's first sync, or with no prompts; an actor call naming no
    policy while the actor holds none."""
    eng = RayRolloutEngine(policies, _cfg())
    with pytest.raises(RuntimeError, match=r"^agent 'char-b': sync_weights\(1\) must be called "
                                           r"before the first generate$"):
        eng.generate(1, PROMPTS, **GEN)
    eng.sync_weights(1)
    with pytest.raises(ValueError, match="^generate needs at least one prompt$"):
        eng.generate(1, [], **GEN)
    eng.close()
    with pytest.raises(RuntimeError, match="^rollout actor has no policy: the call named none$"):
        RolloutActor(1).generate([(0, [])], PROMPTS, torch.Generator().get_state(), GEN)


# -- sampling -------------------------------------------------------------------------------------
def test_one_shard_is_the_local_engine_call_after_call_and_on_resume(stand_in, policies):
    """One prompt on two actors, and 5 prompts on one actor: a single shard gets the agent's
    generator state and gives it back advanced, so every call (with real generation and
    both agents' own seeds) equals the in-process engine's; a restored state repeats a call."""
    prompts = [[1, 56, 70, 66, 62, 21]]
    for engines, ps in ((2, prompts), (1, prompts * 3)):
        local = LocalRolloutEngine(policies, _cfg().seed)
        eng = _pool(policies, engines)
        for k in (1, 0, 1):
            assert eng.generate(k, ps, **GEN) == local.generate(k, ps, **GEN), (engines, k)
        sd = eng.state_dict()
        assert all(map(torch.equal, sd["generators"], local.state_dict()["generators"]))
        want = eng.generate(0, ps, **GEN)
        eng.load_state_dict(sd)
        assert eng.generate(0, ps, **GEN) == want
        eng.close()


def test_shards_get_their_slices_and_seeds_and_merge_in_prompt_order(stand_in, policies,
                                                                     monkeypatch):
    """5 prompts, 2 actors of agent 1 (answering last shard first): actor 0 samples prompts
    0-2 from the first seed drawn from the agent's generator, actor 1 prompts 3-4 from the
    second; the merged rollout keeps each sample with its prompt; the agent's generator is
    left just past the two draws."""
    monkeypatch.setattr(ray_rollout, "generate", _fake_generate)
    eng = _pool(policies)
    gen = torch.Generator()
    gen.set_state(eng.generators[1].get_state())
    seeds = torch.randint(0, 2 ** 62, (2,), generator=gen).tolist()
    got = eng.generate(1, PROMPTS, **GEN)
    actors = eng.actors(1)
    assert _generates(actors[0]) == [[10, 11, 12]] and _generates(actors[1]) == [[13, 14]]
    want = [_fake_generate(policies[1], PROMPTS[a:b], generator=torch.Generator().manual_seed(s),
                           **GEN) for (a, b), s in zip([(0, 3), (3, 5)], seeds)]
    assert got.policy_name == "char-b" and got.prompt_ids == PROMPTS
    assert got.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert got.response_ids == want[0].response_ids + want[1].response_ids
    assert [r[:2] for r in got.response_ids] == [[10 + i // 2, 1] for i in range(10)]
    assert torch.equal(eng.generators[1].get_state(), gen.get_state())
    eng.close()


def test_weight_sync_reaches_every_actor(stand_in, policies):
    """Each sync is a new version that every actor of the agent loads at once (not only when
    it next samples); the actors' weights are then the trainer's."""
    pols = copy.deepcopy(policies)
    eng = RayRolloutEngine(pols, _cfg(**{"rollout.engines_per_agent": 2,
                                         "rollout.weight_bucket_mb": 0.01}))
    for version in range(3):
        perturb_weights(pols[1], version)
        eng.sync_weights(1)
        assert len(eng._weights[1][1]) > 3                     # many buckets
        for h in eng.actors(1):
            assert h.actor.version == version
            got = h.actor.policy.state_dict()
            assert all(torch.equal(got[n], t) for n, t in pols[1].state_dict().items())
    assert [h.actor.version for h in eng.actors(0)] == [-1, -1]   # agent 0's: not synced
    eng.close()


def test_actor_behind_loads_the_requested_weights_before_it_samples(stand_in, policies):
    """An actor asked for weights version 0 while it holds its pickled weights (-1) loads
    them first; a load that failed part-way claims no version and the next request
    reloads; it answers with the version it sampled with."""
    src, dst = copy.deepcopy(policies[0]), copy.deepcopy(policies[0])
    perturb_weights(src, 1)
    state = torch.Generator().manual_seed(3).get_state()
    local = LocalRolloutEngine([src], 0)
    local.generators[0].set_state(state)
    want = local.generate(0, PROMPTS, **GEN)
    actor = RolloutActor(1, dst)
    buckets = [stand_in.put({n: t}) for n, t in src.state_dict().items()]
    with pytest.raises(RuntimeError, match="weights missing"):
        actor.load_weights(0, buckets[:-1])
    assert actor.version is None
    ro, _, _, version = actor.generate([(0, buckets)], PROMPTS, state, GEN)
    assert version == 0 and actor.version == 0 and ro == want


# -- faults ---------------------------------------------------------------------------------------
def _faulty(stand_in, policies, faults, monkeypatch, **over):
    """Agent 1's pool with actor 1's ``faults``; and the fault-free rollout of the call."""
    monkeypatch.setattr(ray_rollout, "generate", _fake_generate)
    eng = _pool(policies, **over)
    ref = _pool(policies)
    want = ref.generate(1, PROMPTS, **GEN)
    ref.close()
    eng.actors(1)[1].faults = faults
    return eng, want


def test_death_in_a_call_resends_only_its_shard(stand_in, policies, monkeypatch):
    """max_engine_restarts=1: actor 1 dies in the call (restart 1 of 1, still retried):
    its shard alone is re-sent, identical, and the rollout is the fault-free one; its
    restarted process's pid is expected, not a second restart. A death past the budget is
    the error naming agent, actor and the last error."""
    eng, want = _faulty(stand_in, policies, {"generate": ["die", None, None, "die"]}, monkeypatch,
                        **{"rollout.max_engine_restarts": 1})
    assert eng.generate(1, PROMPTS, **GEN) == want
    a0, a1 = eng.actors(1)
    assert _generates(a0) == [[10, 11, 12]] and _generates(a1) == [[13, 14]] * 2
    st = eng.stats()
    assert st["restarts_per_actor"] == {"char": [0, 0], "char-b": [0, 1]}
    assert st["restarts"] == 1 and st["retried_calls"] == 1 and st["timeouts"] == 0
    eng.generate(1, PROMPTS, **GEN)                            # the new pid: no restart
    assert eng.stats()["restarts"] == 1
    with pytest.raises(RuntimeError, match=r"^rollout actor 1 of agent 'char-b' died 2 times; "
                                           r"rollout.max_engine_restarts=1 exhausted \(last "
                                           r"error: ActorDiedError"):
        eng.generate(1, PROMPTS, **GEN)
    eng.close()


def test_unavailable_actor_is_retried_without_a_restart(stand_in, policies, monkeypatch):
    """ActorUnavailableError is transient (e.g. a network blip): the call is re-sent and no
    restart counted, since the actor's pid did not change."""
    eng, want = _faulty(stand_in, policies, {"generate": ["unavailable"]}, monkeypatch)
    assert eng.generate(1, PROMPTS, **GEN) == want
    assert eng.stats()["restarts"] == 0 and eng.stats()["retried_calls"] == 1


def test_restart_while_idle_is_counted_and_caught_up(stand_in, policies, monkeypatch):
    """An actor restarted between calls (a new pid, its pickled weights) loads the latest
    weights before it samples, and counts one restart; past the budget it is the error."""
    eng, want = _faulty(stand_in, policies, {}, monkeypatch,
                        **{"rollout.max_engine_restarts": 1})
    a1 = eng.actors(1)[1]
    a1.restart()
    assert eng.generate(1, PROMPTS, **GEN) == want
    assert a1.actor.version == 0
    assert eng.stats()["restarts_per_actor"]["char-b"] == [0, 1]
    eng.generate(1, PROMPTS, **GEN)
    assert eng.stats()["restarts"] == 1
    a1.restart()
    with pytest.raises(RuntimeError, match=r"^rollout actor 1 of agent 'char-b' was restarted 2 "
                                           r"times; rollout.max_engine_restarts=1 exhausted$"):
        eng.sync_weights(1)


def test_hung_call_is_killed_awaited_and_resent(stand_in, policies, monkeypatch):
    """A call past rollout.call_timeout_s: the actor is killed for Ray to restart, the new
    process is awaited (ready calls, until it is no longer unavailable) and the same request
    re-sent; one restart, one timeout. One answered just before its kill is kept, and its
    restart's pid expected."""
    faults = {"generate": ["hang", None, "late_answer"], "ready": ["unavailable"]}
    eng, want = _faulty(stand_in, policies, faults, monkeypatch, **{"rollout.call_timeout_s": 5.0})
    a1 = eng.actors(1)[1]
    n = len(a1.log)
    assert eng.generate(1, PROMPTS, **GEN) == want
    assert stand_in.killed == [(a1, False)]
    assert [c[0] for c in a1.log[n:]] == ["generate", "ready", "ready", "generate"]
    st = eng.stats()
    assert st["restarts_per_actor"]["char-b"] == [0, 1] and st["timeouts"] == 1
    assert st["timeouts_per_actor"] == {"char": [0, 0], "char-b": [0, 1]}
    assert st["retried_calls"] == 1
    eng.generate(1, PROMPTS, **GEN)                            # answered, then killed
    assert stand_in.killed == [(a1, False)] * 2 and _generates(a1)[-1] == [13, 14]
    assert eng.stats()["restarts"] == 2 and eng.stats()["timeouts"] == 2
    eng.generate(1, PROMPTS, **GEN)                            # the new pid: no restart
    assert eng.stats()["restarts"] == 2 and eng.stats()["retried_calls"] == 1


def test_hang_at_the_budget_is_retried_and_past_it_killed_for_good(stand_in, policies,
                                                                   monkeypatch):
    """max_engine_restarts=1: a hung weight load is restart 1 of 1 (killed for Ray to
    restart, re-sent, the actor then holds the weights); the next hang is the error naming
    the call, the timeout and the budget, and the actor is killed without a restart."""
    eng, _ = _faulty(stand_in, policies, {"load_weights": ["hang", None, "hang"]}, monkeypatch,
                     **{"rollout.call_timeout_s": 5.0, "rollout.max_engine_restarts": 1})
    a1 = eng.actors(1)[1]
    eng.sync_weights(1)
    assert stand_in.killed == [(a1, False)] and a1.actor.version == 1
    with pytest.raises(RuntimeError, match=r"^rollout actor 1 of agent 'char-b' did not answer a "
                                           r"load_weights call within rollout.call_timeout_s=5 s"
                                           r" and was killed; that is its restart 2 and "
                                           r"rollout.max_engine_restarts=1 is exhausted"):
        eng.sync_weights(1)
    assert stand_in.killed == [(a1, False), (a1, True)]


def test_kill_that_did_not_take_is_an_error(stand_in, policies, monkeypatch):
    """A hung call still not failed KILL_GRACE_S after its actor was killed: a clear error,
    not a second kill and restart."""
    eng, _ = _faulty(stand_in, policies, {"generate": ["hang_past_kill"]}, monkeypatch,
                     **{"rollout.call_timeout_s": 5.0})
    with pytest.raises(RuntimeError, match=r"^rollout actor 1 of agent 'char-b' was killed after "
                                           r"not answering a generate call within "
                                           r"rollout.call_timeout_s=5 s, but its call has not "
                                           r"failed 60 s later: the kill did not take$"):
        eng.generate(1, PROMPTS, **GEN)
    assert eng.stats()["restarts"] == 1


def test_answer_with_other_weights_is_an_error_and_the_rng_stays(stand_in, policies,
                                                                 monkeypatch):
    """One shard or two: an answer sampled with weights other than the requested version is
    an error naming both, never a sample, and the agent's generator does not advance."""
    for engines in (1, 2):
        eng = _pool(policies, engines)
        monkeypatch.setattr(ray_rollout, "generate", _fake_generate)
        eng.actors(1)[0].faults = {"generate": ["wrong_version"]}
        before = eng.generators[1].get_state()
        with pytest.raises(RuntimeError, match=r"^rollout actor 0 of agent 'char-b' sampled with "
                                               r"weights version 99, expected 0$"):
            eng.generate(1, PROMPTS, **GEN)
        assert torch.equal(eng.generators[1].get_state(), before), engines
        eng.close()
