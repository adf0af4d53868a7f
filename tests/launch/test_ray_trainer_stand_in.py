"""RayAgents and its TrainerActors against the in-process trainer (LocalAgents), without a
cluster: each actor is a TrainerActor in this process behind a stand-in handle (``.remote``
runs the method), so every call RayAgents makes, and what the actor does with it, is checked
on settings a tiny3 run leaves at their defaults (tests/launch/test_ray_trainer.py covers the
real actors): agents with their own learning rate and grad clip, the KL term and its frozen
reference policy, a sampling temperature other than 1 (old log-probs and ratios), gspo2x's
doubled minibatch count, the ratio log, and a checkpoint loaded into actors whose own
reference policy differs from the checkpoint's."""
import copy
import dataclasses

import pytest
import torch

from hacpo.engine import preset
from hacpo.engine.agents import LocalAgents, score_temperature, update_agents
from hacpo.engine.pool import LearnerView, StepPool, scored_lengths
from hacpo.engine.run_config import load_config
from hacpo.engine.timing import Stopwatch
from hacpo.engine.update import NonFiniteUpdateError
from hacpo.launch import ray_trainer
from hacpo.models.policy import build_policy

P, G = 8, 2                   # prompts, responses per prompt and agent


class _Call:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        return lambda: self.fn(*args, **kwargs)


class _Handle:
    """Stand-in for a Ray actor handle: ``handle.method.remote(...)`` is a reference that runs
    the method when RayAgents awaits it (a call it never awaits never runs: its errors would
    be lost with Ray)."""

    def __init__(self, actor):
        self.actor = actor

    def __getattr__(self, name):
        return _Call(getattr(self.actor, name))


def _stand_in(cfg, policies) -> ray_trainer.RayAgents:
    """RayAgents over in-process TrainerActors (each gets its own copy of the policy, as the
    real actors get a pickled one); ``_get`` runs the call."""
    ra = ray_trainer.RayAgents.__new__(ray_trainer.RayAgents)
    ra.cfg, ra.policies, ra.names = cfg, list(policies), [p.name for p in policies]
    ra._actors = [_Handle(ray_trainer.TrainerActor(copy.deepcopy(p), cfg, k, 1))
                  for k, p in enumerate(policies)]
    ra._get = lambda k, ref: ref()
    return ra


def _cfg(algorithm: str):
    """Two char agents (one tokenizer: cross samples need no re-tokenization here) that differ
    in model, learning rate and grad clip (agent 1's clip binds, agent 0's does not), the KL
    term on, sampling temperature 0.7."""
    cfg = load_config("tiny3", overrides={"rollout.temperature": 0.7, "threads": 1})
    cfg = dataclasses.replace(cfg, algorithm=preset(algorithm, {"loss.kl_coef": 0.5}))
    a = cfg.agents[0]
    b = dataclasses.replace(a, policy=dataclasses.replace(a.policy, name="char-b", seed=7),
                            optim=dataclasses.replace(a.optim, lr=2e-2, grad_clip=1e-3))
    a = dataclasses.replace(a, optim=dataclasses.replace(a.optim, lr=1e-3, grad_clip=1e3))
    return dataclasses.replace(cfg, agents=[a, b])


def _policies(cfg, shift: float = 0.0):
    pols = [build_policy(a.policy) for a in cfg.agents]
    with torch.no_grad():
        for p in pols:
            for t in p.parameters():
                t.add_(shift)
    return pols


def _pool(cfg, policies):
    """P prompts x G responses per agent (agent-major, then prompt-major), some ending in EOS;
    and each agent's prompt ids."""
    tok = policies[0].tokenizer
    prompt_ids = [[p.tokenizer.prompt_ids(f"What is {i} + {2 * i + 1}?") for i in range(P)]
                  for p in policies]
    g = torch.Generator().manual_seed(11)
    agent, prompt, resp = [], [], []
    for k in range(len(policies)):
        for i in range(P):
            for j in range(G):
                digits = "".join(str(int(d)) for d in torch.randint(10, (3 + j + i,),
                                                                    generator=g))
                ids = tok.encode(f"{digits} = {i}")
                agent.append(k)
                prompt.append(i)
                resp.append(ids + [tok.eos_id] if (i + j + k) % 2 else ids)
    n = len(resp)
    pool = StepPool(torch.tensor(agent), torch.tensor(prompt), resp, [""] * n, [True] * n,
                    [False] * n)
    return pool, prompt_ids


def _views(cfg, pool, prompt_ids, eos_id):
    lens = scored_lengths(pool.response_ids, eos_id)
    g = torch.Generator().manual_seed(5)
    views = []
    for k in range(len(cfg.agents)):
        idx = (torch.arange(pool.num_samples) if cfg.algorithm.shares_samples
               else (pool.agent == k).nonzero().flatten())
        views.append(LearnerView(
            idx, torch.randn(idx.numel(), generator=g), 0.5 + torch.rand(idx.numel(), generator=g),
            pool.agent[idx] == k, [prompt_ids[k][int(pool.prompt[i])] for i in idx],
            [pool.response_ids[i][:lens[i]] for i in idx], {}))
    return views


def _step(group, cfg, pool, prompt_ids, views, *, at_once: bool, shuffle_seed: int = 3):
    """old log-probs, every agent's update, weights pulled: what one step asks of a group.
    Returns (metrics, shuffle RNG state after, non-finite counters, ratio logs, lp_old,
    old token log-probs, the stage-time keys)."""
    pool = copy.copy(pool)
    sw = Stopwatch()
    group.old_logprobs(pool, prompt_ids, cfg.micro_batch, score_temperature(cfg), sw)
    gen = torch.Generator().manual_seed(shuffle_seed)
    nonfinite = {"streak": 0, "total": 0}
    logs = [{} for _ in views]
    m = update_agents(group, views, pool, generator=gen, nonfinite=nonfinite, ratio_logs=logs,
                      sw=sw, timer=lambda k: Stopwatch()("x"), at_once=at_once)
    for k in range(len(views)):
        group.pull_weights(k)
    return m, gen.get_state(), nonfinite, logs, pool.lp_old, pool.old_token_logp, sorted(sw)


def _old_logprobs(group, cfg, pool, prompt_ids):
    pool = copy.copy(pool)
    group.old_logprobs(pool, prompt_ids, cfg.micro_batch, score_temperature(cfg), Stopwatch())
    return pool


def _same_logs(a: list[dict], b: list[dict]) -> bool:
    """Ratio logs (per agent: part -> one tensor per minibatch) equal tensor for tensor."""
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(len(x[p]) == len(y[p]) and all(
            torch.equal(u, v) for u, v in zip(x[p], y[p])) for p in x) for x, y in zip(a, b))


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)


@pytest.mark.parametrize("algorithm", ["hacpo", "gspo2x"])
def test_actors_train_as_the_local_trainer_on_per_agent_settings(algorithm):
    """One step with both agents: the stand-in actors updating at once (update_all: the driver
    draws every agent's minibatches) and one after another (update: the shuffle RNG travels
    with each request) give the local trainer's old log-probs, metrics, shuffle RNG state,
    ratio logs and weights exactly, and the driver's copies hold the trained weights."""
    cfg = _cfg(algorithm)
    base = _policies(cfg)
    pool, prompt_ids = _pool(cfg, base)
    views = _views(cfg, pool, prompt_ids, base[0].tokenizer.eos_id)

    local = LocalAgents(cfg, copy.deepcopy(base))
    want = _step(local, cfg, pool, prompt_ids, views, at_once=True)
    m, state, nonfinite, logs, lp_old, token_lp, stages = want
    # the settings under test act here: the temperature changes old log-probs, agent 1's clip
    # binds (its gradient's norm is far above it), every agent keeps a ratio log
    lp_t1 = copy.copy(pool)
    LocalAgents(cfg, copy.deepcopy(base)).old_logprobs(lp_t1, prompt_ids, cfg.micro_batch,
                                                         1.0, Stopwatch())
    assert torch.isfinite(lp_old).all() and not torch.allclose(lp_t1.lp_old, lp_old)
    assert m[1]["grad_norm"] > 100 * cfg.agents[1].optim.grad_clip
    assert all(log for log in logs) and nonfinite == {"streak": 0, "total": 0}
    # one ratio-log entry per minibatch: tiny3's 4, twice as many for gspo2x (SPEC), P >= 8
    assert cfg.algorithm.num_minibatches == 4
    M = 8 if algorithm == "gspo2x" else 4
    assert all(len(log["self"]) == M for log in logs), [len(log["self"]) for log in logs]
    assert not _same_weights(local.policies[0], base[0])

    for at_once in (True, False):
        ra = _stand_in(cfg, copy.deepcopy(base))
        got = _step(ra, cfg, pool, prompt_ids, views, at_once=at_once)
        assert torch.equal(got[4], lp_old)
        assert len(got[5]) == len(token_lp) and all(torch.equal(a, b)
                                                    for a, b in zip(got[5], token_lp))
        assert got[6] == stages and "time/score_self/char-b" in stages, got[6]
        assert got[0] == m and got[2] == nonfinite and _same_logs(got[3], logs)
        assert torch.equal(got[1], state)
        for k in range(2):
            assert _same_weights(ra.policies[k], local.policies[k]), (at_once, k)


def test_checkpoint_round_trip_restores_policy_optimizer_and_reference():
    """state_dict of a trained actor holds its policy, AdamW state and KL reference; loaded
    into a fresh group whose own policies and reference policies are other weights, it makes
    the actors (and the driver's copies) train the next step exactly as the local trainer
    restored from the same checkpoint."""
    cfg = _cfg("hacpo")
    base = _policies(cfg)
    pool, prompt_ids = _pool(cfg, base)
    views = _views(cfg, pool, prompt_ids, base[0].tokenizer.eos_id)
    ra = _stand_in(cfg, copy.deepcopy(base))
    _step(ra, cfg, pool, prompt_ids, views, at_once=True)
    sds = [ra.state_dict(k) for k in range(2)]
    for sd in sds:
        assert set(sd) == {"model", "optim", "ref_model"} and sd["optim"]["state"]

    other = _policies(cfg, shift=0.01)         # fresh groups start from other weights
    local, fresh = LocalAgents(cfg, copy.deepcopy(other)), _stand_in(cfg, copy.deepcopy(other))
    for k, sd in enumerate(sds):
        local.load_state_dict(k, copy.deepcopy(sd))
        fresh.load_state_dict(k, copy.deepcopy(sd))
        want_model = sd["model"]
        assert all(torch.equal(fresh.policies[k].state_dict()[n], t)
                   for n, t in want_model.items())           # the driver's copy too
    want = _step(local, cfg, pool, prompt_ids, views, at_once=True, shuffle_seed=4)
    got = _step(fresh, cfg, pool, prompt_ids, views, at_once=True, shuffle_seed=4)
    assert got[0] == want[0]
    assert [float(x["kl"]) for x in got[0]] == [float(x["kl"]) for x in want[0]]
    for k in range(2):
        assert _same_weights(fresh.policies[k], local.policies[k])
    # what the check can see: from the fresh groups' own reference policies (not the
    # checkpoint's), the step's KL term is another one
    unloaded = LocalAgents(cfg, copy.deepcopy(other))
    for k, sd in enumerate(sds):
        unloaded.load_state_dict(k, {**copy.deepcopy(sd), "ref_model": other[k].state_dict()})
    wrong = _step(unloaded, cfg, pool, prompt_ids, views, at_once=True, shuffle_seed=4)
    assert [x["kl"] for x in wrong[0]] != [x["kl"] for x in want[0]]


def test_non_finite_updates_are_counted_across_agents_as_the_local_trainer():
    """Agent 0's updates are all non-finite (NaN advantages), agent 1's finite: with the
    run's limit above agent 0's streak, both ways the actors update (at once: traces replayed
    by the driver; one after another: the counters travel with each request) leave the run's
    counters, metrics and weights the local trainer's (a streak of 0 after agent 1, agent 0's
    non-finite updates in the total)."""
    cfg = dataclasses.replace(_cfg("hacpo"), max_nonfinite=5)
    base = _policies(cfg)
    pool, prompt_ids = _pool(cfg, base)
    views = _views(cfg, pool, prompt_ids, base[0].tokenizer.eos_id)
    views[0] = dataclasses.replace(views[0], advantages=torch.full_like(views[0].advantages,
                                                                        float("nan")))
    want = _step(LocalAgents(cfg, copy.deepcopy(base)), cfg, pool, prompt_ids, views,
                 at_once=True)
    assert want[2] == {"streak": 0, "total": 4, "agents": {"char": 4}}   # its own streak
    # a run limit of 3: agent 0's actor stops at its third update; the run stops there with
    # the local trainer's error and counters
    stop = dataclasses.replace(cfg, max_nonfinite=3)
    with pytest.raises(NonFiniteUpdateError) as e:
        _step(LocalAgents(stop, copy.deepcopy(base)), stop, pool, prompt_ids, views,
              at_once=True)
    want_err = str(e.value)
    assert "3 non-finite updates in a row for policy 'char'" in want_err
    for at_once in (True, False):
        ra = _stand_in(stop, copy.deepcopy(base))
        counters = {"streak": 0, "total": 0}
        with pytest.raises(NonFiniteUpdateError) as e:
            update_agents(ra, views, _old_logprobs(ra, stop, pool, prompt_ids),
                          generator=torch.Generator().manual_seed(3), nonfinite=counters,
                          ratio_logs=[None, None], sw=Stopwatch(),
                          timer=lambda k: Stopwatch()("x"), at_once=at_once)
        assert str(e.value) == want_err, at_once
        if at_once:     # the driver's replay counted the trace (one after another, the
            assert counters == {"streak": 3, "total": 3,    # actor's error ends the run)
                                "agents": {"char": 3}}
    for at_once in (True, False):
        ra = _stand_in(cfg, copy.deepcopy(base))
        got = _step(ra, cfg, pool, prompt_ids, views, at_once=at_once)
        assert got[2] == want[2], at_once
        assert str(got[0]) == str(want[0])          # NaN metrics compare as text
        assert _same_weights(ra.policies[0], base[0]) and not _same_weights(ra.policies[1],
                                                                            base[1])


def test_drawn_update_result_that_stopped_short_of_the_run_limit_is_an_error():
    """An actor that stopped on non-finite updates (metrics None) although replaying its
    trace into the run's counters did not reach max_nonfinite cannot be taken as a result."""
    trace = [{"finite": False, "loss": float("nan"), "grad_norm": float("nan")}]
    counters = {"streak": 0, "total": 0}
    with pytest.raises(RuntimeError, match=r"agent 'b': its trainer stopped on non-finite "
                                           r"updates, but the run's count did not reach "
                                           r"max_nonfinite=3"):
        ray_trainer.drawn_update_result((None, trace, None, {}, (0.0, 1.0)), "b", counters, 3,
                                        None, {})
    assert counters == {"streak": 1, "total": 1, "agents": {"b": 1}}
    m = {"loss": 0.5}
    sw: dict = {}
    assert ray_trainer.drawn_update_result((m, [], {"self": [1]}, {"time/x/b": 2.0}, (0, 1)),
                                           "b", counters, 3, None, sw) is m
    assert sw == {"time/x/b": 2.0}


def test_actor_update_takes_the_actors_counters_whole():
    """One agent after another, the counters travel with each request and come back: a
    policy's own streak the actor ended (a key it removed) stayed in the driver's counters,
    and stopped the run later on a streak that had ended."""
    class Actor:
        class update:                      # noqa: N801 (a stand-in for actor.update.remote)
            @staticmethod
            def remote(*args):
                return ({"loss": 0.5}, torch.Generator().get_state(), {"streak": 0, "total": 1},
                        None, {})
    counters = {"streak": 1, "total": 1, "agents": {"b": 1}}
    import types
    pool = types.SimpleNamespace(lp_old=None, old_token_logp=None, prompt=None)
    m = ray_trainer.actor_update(lambda ref: ref, Actor, None, pool,
                                 generator=torch.Generator(), nonfinite=counters,
                                 ratio_log=None, sw={})
    assert m == {"loss": 0.5} and counters == {"streak": 0, "total": 1}
