"""RayAgents without a Ray cluster (a mutation audit's tests): the module's ``ray``,
``connect``, ``RayCluster`` and placement strategy are in-process stand-ins, and each actor is
a TrainerActor in this process behind test_ray_trainer_stand_in's stand-in handle. Checked:
how the group is started (the cluster's size, one placement group and actor per agent, no
restarts, each actor its own agent's policy, settings, reward and threads, the start waits
naming their agent), a failed start and close releasing everything, a hung call (the actor
killed for good, the error naming agent and limit) and a dead actor named by every call,
each agent's own prompts, minibatches, ratio log and wait timer in the updates, and the
held-out evaluation in agent order. (tests/launch/test_ray_trainer.py covers real actors.)"""
import contextlib
import copy
import dataclasses
import os

import pytest
import torch

from hacpo.engine.agents import LocalAgents, update_agents
from hacpo.engine.rewards import get_reward_spec
from hacpo.engine.timing import Stopwatch
from hacpo.launch import ray_trainer

from ._launch_helpers import install_ray_stand_ins
from .test_ray_rollout_mutants import _Cluster
from .test_ray_trainer_stand_in import (_Handle, _cfg, _old_logprobs, _policies, _pool,
                                        _same_logs, _same_weights, _stand_in, _views)

from ray.exceptions import ActorDiedError, GetTimeoutError


class _Ray:
    """The module's ``ray``: an actor is a TrainerActor made here from what ``remote`` is
    sent (behind the stand-in handle: a reference runs its call when awaited); ``put`` a
    snapshot, as ray.put takes; ``get`` records its timeout; ``kill`` is recorded."""

    def __init__(self):
        self.made, self.timeouts, self.killed = [], [], []

    def remote(self, cls):
        assert cls is ray_trainer.TrainerActor
        made = self.made

        class Cls:
            @staticmethod
            def options(**opts):
                class Actor:
                    @staticmethod
                    def remote(policy, *args):
                        h = _Handle(cls(policy(), *args))
                        made.append((h, opts))
                        return h
                return Actor
        return Cls

    def put(self, x):
        snap = copy.deepcopy(x)
        return lambda: snap

    def get(self, ref, timeout=None):
        self.timeouts.append(timeout)
        return ref()

    def kill(self, handle, no_restart):
        self.killed.append((handle, no_restart))

    @staticmethod
    def is_initialized():
        return True


class _TrainerCluster(_Cluster):
    def wait_started(self, ref, *, what, timeout_s):
        self.log.append(("wait_started", what, timeout_s))
        return ref()


@pytest.fixture
def stand_in(monkeypatch):
    """Installs the stand-ins; yields the module's stand-in ``ray``, whose ``log`` has the
    cluster's calls and ``released`` what ``close`` released."""
    threads = torch.get_num_threads()
    yield install_ray_stand_ins(monkeypatch, ray_trainer, _Ray(), _TrainerCluster)
    torch.set_num_threads(threads)


def _ray_cfg(threads=3, engines=None, **over):
    """_cfg's two char agents (own learning rate and grad clip) on trainer_backend=ray, with
    the Ray rollout pool of ``engines`` actors per agent."""
    cfg = dataclasses.replace(_cfg("hacpo"), trainer_backend="ray", threads=threads, **over)
    if engines:
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(
            cfg.rollout, engine="ray", engines_per_agent=engines))
    return cfg


class _Workers:
    """A TrainerActor's reward computer: records its close."""
    closed = False

    def close(self):
        self.closed = True


# -- bring-up and close ---------------------------------------------------------------------------
def test_group_start_one_actor_per_agent_with_its_own_policy_settings_and_reward(stand_in):
    """2 agents x 3 threads with a Ray rollout pool of E actors of 3 threads per agent: the
    private cluster holds both (6 + 6E CPUs); one placement group per agent of one 3-CPU
    bundle, its actor never restarted (an optimizer's state cannot be rebuilt) nor a call
    retried; each actor holds a copy of its own agent's policy, that agent's learning rate and
    grad clip, the driver's reward and the run's threads, and its start is awaited for
    start_timeout_s, naming its agent. close, twice: every actor's reward workers stopped,
    actors and groups released and the cluster shut down once."""
    engines = os.cpu_count() or 1
    cfg = _ray_cfg(engines=engines)
    pols = _policies(cfg)
    ra = ray_trainer.RayAgents(cfg, pols, start_timeout_s=77.0)
    log = stand_in.log
    assert log[0] == ("connect", 6 + 6 * engines)
    assert log[1][:3] == ("require", "CPU", 6)
    assert "needs 6 CPUs (2 agents x 3 CPU each, threads=3)" in log[1][3]
    assert log[2:4] == [("reserve", [{"CPU": 3}])] * 2
    assert log[4:] == [("wait_started", "the trainer actor of agent 'char'", 77.0),
                       ("wait_started", "the trainer actor of agent 'char-b'", 77.0)]
    assert torch.get_num_threads() == 3
    for k, (h, opts) in enumerate(stand_in.made):
        assert opts == {"num_cpus": 3, "max_restarts": 0, "max_task_retries": 0,
                        "scheduling_strategy": {"placement_group": f"pg{k + 1}",
                                                "placement_group_bundle_index": 0}}
        a = h.actor
        assert a.policy.name == pols[k].name and a.policy is not pols[k]
        assert _same_weights(a.policy, pols[k])
        assert a.optim.param_groups[0]["lr"] == cfg.agents[k].optim.lr
        assert a.grad_clip == cfg.agents[k].optim.grad_clip
        assert a.reward == get_reward_spec(cfg.reward.name) and a.reward is not None
        a._rc = _Workers()
    assert cfg.agents[0].optim.lr != cfg.agents[1].optim.lr          # the check can fail
    workers = [h.actor._rc for h, _ in stand_in.made]
    ra.close()
    ra.close()                                                    # idempotent
    assert all(w.closed for w in workers)
    assert all(h.actor._rc is None for h, _ in stand_in.made)
    assert stand_in.released == [([h for h, _ in stand_in.made], ["pg1", "pg2"])]
    assert log.count(("shutdown",)) == 1


def test_unset_threads_is_one_cpu_per_actor(stand_in):
    """threads=0 (torch's default in-process) gives each actor one thread and one CPU."""
    cfg = _ray_cfg(threads=0)
    ra = ray_trainer.RayAgents(cfg, _policies(cfg))
    assert stand_in.log[2] == ("reserve", [{"CPU": 1}])
    assert [opts["num_cpus"] for _, opts in stand_in.made] == [1, 1]
    assert torch.get_num_threads() == 1
    ra.close()


def test_failed_start_releases_the_cluster(stand_in, monkeypatch):
    """A start that fails once connected (here: too few CPUs) closes the group: a private
    cluster is not left running."""
    monkeypatch.setattr(_Cluster, "fail_require", True)
    cfg = _ray_cfg()
    with pytest.raises(RuntimeError, match="too small"):
        ray_trainer.RayAgents(cfg, _policies(cfg))
    assert stand_in.log[-1] == ("shutdown",)


def test_policy_off_the_cpu_is_a_clear_error(stand_in):
    """The actors train on CPUs: a policy elsewhere is refused before any cluster is asked."""
    cfg = _ray_cfg()
    pols = _policies(cfg)
    pols[1] = pols[1].to("meta")
    with pytest.raises(ValueError, match=r"^trainer_backend=ray trains on CPU actors, but "
                                         r"policy 'char-b' is on meta$"):
        ray_trainer.RayAgents(cfg, pols)
    assert stand_in.log == []


# -- calls that fail ------------------------------------------------------------------------------
def _waited(ra):
    """``ra`` awaiting its calls with RayAgents._get through the stand-in ``ray``."""
    del ra._get
    return ra


def test_hung_call_kills_the_actor_for_good_and_names_agent_and_limit(stand_in):
    """A call past trainer_call_timeout_s: that agent's actor is killed without a restart and
    the error names the agent, the limit and --resume; 0 waits without a limit."""
    cfg = dataclasses.replace(_cfg("hacpo"), trainer_call_timeout_s=7.5)
    ra = _waited(_stand_in(cfg, _policies(cfg)))

    def hang():
        raise GetTimeoutError("no answer")
    with pytest.raises(RuntimeError) as e:
        ra._get(1, hang)
    assert str(e.value) == (
        "the trainer actor of agent 'char-b' did not answer a call within "
        "trainer_call_timeout_s=7.5 s (alive but hung) and was killed; its policy and optimizer "
        "state cannot be recovered mid-step: resume the run from its last checkpoint with "
        "--resume (and raise trainer_call_timeout_s if its steps are legitimately this slow)")
    assert stand_in.killed == [(ra._actors[1], True)] and stand_in.timeouts == [7.5]
    ra.cfg = dataclasses.replace(cfg, trainer_call_timeout_s=0)
    assert ra._get(0, lambda: 5) == 5 and stand_in.timeouts[-1] is None


class _Dead:
    """A dead actor's handle: every call's reference raises ActorDiedError."""

    def __getattr__(self, name):
        class Call:
            @staticmethod
            def remote(*args):
                def dead():
                    raise ActorDiedError()
                return dead
        return Call


def test_every_call_to_a_dead_actor_names_its_agent(stand_in):
    """Agent char-b's actor died: each call that reaches it is the error naming that agent
    and --resume (not agent 0, not Ray's error), and nothing is killed."""
    cfg = _cfg("hacpo")
    base = _policies(cfg)
    pool, prompt_ids = _pool(cfg, base)
    views = _views(cfg, pool, prompt_ids, base[0].tokenizer.eos_id)
    ra = _waited(_stand_in(cfg, base))
    sd, scored = ra.state_dict(0), _old_logprobs(ra, cfg, pool, prompt_ids)
    ra._actors[1] = _Dead()
    calls = {
        "state_dict": lambda: ra.state_dict(1),
        "load_state_dict": lambda: ra.load_state_dict(1, sd),
        "pull_weights": lambda: ra.pull_weights(1),
        "evaluate": lambda: ra.evaluate(prompt_ids, ["1"] * len(prompt_ids[0]), None,
                                        max_new_tokens=2),
        "old_logprobs": lambda: _old_logprobs(ra, cfg, pool, prompt_ids),
    }
    for what, call in calls.items():
        with pytest.raises(RuntimeError) as e:
            call()
        assert str(e.value) == (
            "the trainer actor of agent 'char-b' died (ActorDiedError); its policy and "
            "optimizer state cannot be recovered mid-step: resume the run from its last "
            "checkpoint with --resume"), what
        assert isinstance(e.value.__cause__, ActorDiedError)
    with pytest.raises(RuntimeError, match=r"^the trainer actor of agent 'char-b' died"):
        update_agents(ra, views, scored, generator=torch.Generator().manual_seed(3),
                      nonfinite={"streak": 0, "total": 0}, ratio_logs=[None, None],
                      sw=Stopwatch(), timer=lambda k: contextlib.nullcontext())
    assert stand_in.killed == []


# -- what each agent is sent ----------------------------------------------------------------------
def test_old_logprobs_score_each_agents_samples_on_its_own_prompt_tokenization():
    """Agents whose tokenizations of the prompts differ: each actor scores its agent's
    samples after that agent's own prompt ids, as the local trainer does."""
    cfg = _cfg("hacpo")
    base = _policies(cfg)
    pool, prompt_ids = _pool(cfg, base)
    tok = base[1].tokenizer
    prompt_ids = [prompt_ids[0], [tok.prompt_ids(f"Add {i} and 7.") for i in range(len(
        prompt_ids[0]))]]
    want = _old_logprobs(LocalAgents(cfg, copy.deepcopy(base)), cfg, pool, prompt_ids)
    got = _old_logprobs(_stand_in(cfg, copy.deepcopy(base)), cfg, pool, prompt_ids)
    assert torch.equal(got.lp_old, want.lp_old)
    assert all(torch.equal(a, b) for a, b in zip(got.old_token_logp, want.old_token_logp))
    same = _old_logprobs(LocalAgents(cfg, copy.deepcopy(base)), cfg, pool,
                         [prompt_ids[0]] * 2)
    assert not torch.equal(same.lp_old, want.lp_old)             # the check can fail


def test_update_all_sends_each_agent_its_own_minibatches_ratio_log_and_timer():
    """Agent 1's learner without 3 of the cross samples agent 0's trains on (dropped as
    unencodable), agent 0 without a ratio log and agent 1 with one: the actors updating at
    once train as the local trainer does one agent after another (the driver draws each
    agent's minibatches from its own view), agent 1's ratio log alone is kept, and each
    agent's wait is timed under its own index."""
    cfg = _cfg("hacpo")
    base = _policies(cfg)
    pool, prompt_ids = _pool(cfg, base)
    views = _views(cfg, pool, prompt_ids, base[0].tokenizer.eos_id)
    v = views[1]
    keep = torch.arange(v.idx.numel()) >= 3
    assert not v.is_self[~keep].any()
    views[1] = dataclasses.replace(
        v, idx=v.idx[keep], advantages=v.advantages[keep], omega=v.omega[keep],
        is_self=v.is_self[keep], prompt_ids=[p for p, k in zip(v.prompt_ids, keep) if k],
        response_ids=[r for r, k in zip(v.response_ids, keep) if k])

    def step(group, entered):
        p = _old_logprobs(group, cfg, pool, prompt_ids)
        gen, logs = torch.Generator().manual_seed(3), [None, {}]

        def timer(k):
            entered.append(k)
            return contextlib.nullcontext()
        m = update_agents(group, views, p, generator=gen, nonfinite={"streak": 0, "total": 0},
                          ratio_logs=logs, sw=Stopwatch(), timer=timer)
        for k in range(2):
            group.pull_weights(k)
        return m, gen.get_state(), logs

    local, ra = LocalAgents(cfg, copy.deepcopy(base)), _stand_in(cfg, copy.deepcopy(base))
    entered = []
    want, got = step(local, []), step(ra, entered)
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    assert got[2][0] is None is want[2][0] and got[2][1]
    assert _same_logs(got[2][1:], want[2][1:])
    for k in range(2):
        assert _same_weights(ra.policies[k], local.policies[k]), k
    assert sorted(entered) == [0, 1]


def test_evaluate_sends_each_agent_its_prompts_and_keeps_agent_order(monkeypatch):
    """Held-out evaluation: each actor evaluates its agent's tokenization of the prompts
    with the run's settings and a reward computer of the actor's reward (the driver's spec,
    the run's workers and limit); the results come back in agent order."""
    seen = []

    def evaluate_policy(policy, prompt_ids, golds, rc, **kw):
        seen.append(rc)
        return {"policy": policy.name, "prompts": prompt_ids, "golds": golds, **kw}
    monkeypatch.setattr(ray_trainer, "evaluate_policy", evaluate_policy)
    cfg = _cfg("hacpo")
    cfg = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, timeout_s=3.5))
    ra = _stand_in(cfg, _policies(cfg))
    spec = dataclasses.replace(get_reward_spec("exact"), name="driver's")
    for h in ra._actors:
        h.actor.reward = spec
    got = ra.evaluate([[[1]], [[2]]], ["g"], None, max_new_tokens=4)
    assert got == [{"policy": "char", "prompts": [[1]], "golds": ["g"], "max_new_tokens": 4},
                   {"policy": "char-b", "prompts": [[2]], "golds": ["g"], "max_new_tokens": 4}]
    assert [rc.spec for rc in seen] == [spec, spec]
    assert [(rc.num_workers, rc.timeout_s) for rc in seen] == [(cfg.reward.num_workers, 3.5)] * 2
