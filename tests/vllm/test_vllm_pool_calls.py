"""VLLMRolloutEngine.generate and its call loop against stand-in engine actors in a real private
Ray cluster (no vLLM, a few seconds): how prompts and seeds are split over an agent's engines
and put back together, and what a dead, hung or broken engine does to a call.

A stand-in sample is a pure function of (prompt row, seed) that shows both, so a sample paired
with the wrong prompt, a seed used twice or not at all, a shard lost or sent twice, or a retry
with other seeds is seen directly. The samples expected come from the documented contract (one
seed per sample, drawn in prompt-major order from the agent's generator,
``agent_generators``), not from the pool's code; that the split over 1, 2 or 3 engines gives
the same samples is checked too. Every call an engine receives is logged (before any fault),
so the tests count what was sent to whom.
"""
import os
import time
import types

import pytest
import torch

from hacpo.engine.rollout import agent_generators
from hacpo.launch import ray_cluster  # noqa: F401  (first: its environment precedes `import ray`)
from hacpo.launch._vllm_worker import EngineDied
from hacpo.launch.vllm_rollout import VLLMRolloutEngine

EOS, VOCAB, MAX_NEW, G, SEED = 2, 64, 5, 3, 7
POLICY = types.SimpleNamespace(name="fake", max_len=64,
                               tokenizer=types.SimpleNamespace(eos_id=EOS, vocab_size=VOCAB))
PROMPTS = [[10 + i, 20 + i] for i in range(5)]      # prompt i starts with id 10 + i
GEN = dict(num_samples=G, max_new_tokens=MAX_NEW, temperature=1.0, top_p=1.0)


def sample(prompt, seed, max_tokens):
    """The stand-in's response to one row: its first token names the prompt, its length and
    tokens follow the seed; EOS-terminated ("stop") unless it runs to ``max_tokens``."""
    n = 2 + seed % max_tokens                  # 2 .. max_tokens + 1
    if n > max_tokens:
        ids = [prompt[0]] + [3 + (seed >> (4 * t)) % 50 for t in range(max_tokens - 1)]
        return ids, "length"
    ids = [prompt[0]] + [3 + (seed >> (4 * t)) % 50 for t in range(n - 2)] + [EOS]
    return ids, "stop"


class _Log:
    """Every generate call any engine received: (engine tag, [(first prompt id, seed)])."""

    def __init__(self):
        self.calls = []

    def add(self, tag, rows):
        self.calls.append((tag, rows))

    def get(self):
        return self.calls


class _Engine:
    """Stands in for VLLMWorker. ``faults``: what its successive generate calls do, after
    logging the call: "die" (the process exits), "hang" (never answers), "engine_died" (a
    vLLM worker process died: EngineDied), "drop" (one sample fewer), "short_lps" (one log-prob
    fewer than tokens); anything else, or none left, answers normally."""

    def __init__(self, log, tag, faults=(), version=0):
        self.log, self.tag, self.faults, self.version = log, tag, list(faults), version

    def info(self):
        return {"pid": os.getpid(), "vllm": "stand-in"}

    def load_weights(self, weights, *, version):
        self.version = version
        return 0

    def generate(self, prompts, seeds, *, max_tokens, temperature, top_p, eos_id, version):
        import ray

        ray.get(self.log.add.remote(self.tag, [(p[0], int(s)) for p, s in zip(prompts, seeds)]))
        fault = self.faults.pop(0) if self.faults else None
        if fault == "die":
            os._exit(1)
        if fault == "hang":
            time.sleep(600)
        if fault == "engine_died":
            raise EngineDied("vLLM's executor has failed: worker process(es) VllmWorker-1 "
                             "(exit code -9) died")
        if version != self.version:
            raise RuntimeError(f"vLLM engine holds weights version {self.version}, the "
                               f"request needs version {version}")
        out = []
        for p, s in zip(prompts, seeds):
            ids, reason = sample(p, int(s), max_tokens)
            out.append((ids, [-0.5] * (len(ids) - (fault == "short_lps")), reason))
        return out[:-1] if fault == "drop" else out

    def shutdown(self):
        pass


class Pool:
    """A VLLMRolloutEngine of one agent over stand-in engines; ``faults[j]``: engine j's
    faults; ``restart_faults``: the faults of each engine the pool restarts, in order."""

    def __init__(self, faults, *, max_restarts=2, call_timeout_s=0, restart_faults=()):
        import ray

        self.ray = ray
        self.log = ray.remote(_Log).options(num_cpus=0).remote()
        self.made = []
        self.restart_faults = list(restart_faults)
        e = len(faults)
        pool = self.pool = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
        pool.policies, pool.python, pool._cluster, pool._closed = [POLICY], "python", None, False
        pool.engines_per_agent, pool.generators = e, agent_generators(SEED, 1)
        pool._weights, pool._version = [None], [0]
        pool.call_timeout_s, pool.max_restarts, pool.start_timeout_s = (call_timeout_s,
                                                                        max_restarts, 60)
        pool.restarts, pool.timeouts = [[0] * e], [[0] * e]
        pool.actors = [[self._engine(str(j), f) for j, f in enumerate(faults)]]
        ray.get([a.info.remote() for a in pool.actors[0]])     # started: no call waits on it
        pool._new_actor = lambda k, j: self._engine(
            f"{j}r", self.restart_faults.pop(0) if self.restart_faults else ())

    def _engine(self, tag, faults):
        a = self.ray.remote(_Engine).options(num_cpus=0, max_restarts=0).remote(
            self.log, tag, faults, self.pool._version[0])
        self.made.append(a)
        return a

    def calls(self):
        return self.ray.get(self.log.get.remote())

    def close(self):
        for a in self.made + [self.log]:
            self.ray.kill(a, no_restart=True)


def expected(calls=1):
    """The samples of the agent's ``calls``-th generate of PROMPTS (documented contract)."""
    g = agent_generators(SEED, 1)[0]
    for _ in range(calls):
        seeds = torch.randint(2 ** 62, (len(PROMPTS) * G,), generator=g).tolist()
    rows = [(PROMPTS[n // G], s) for n, s in enumerate(seeds)]
    return [sample(p, s, MAX_NEW)[0] for p, s in rows], [(p[0], s) for p, s in rows]


def sent_rows(calls):
    return sorted(r for _, rows in calls for r in rows)


@pytest.mark.parametrize("engines", [1, 2, 3])
def test_samples_are_the_contracts_whatever_the_split(cluster, engines):
    """5 prompts x 3 samples over 1, 2 or 3 engines: the same samples, each with its own
    prompt and seed, every (prompt, seed) row sent once, contiguous prompt slices in engine
    order; the agent's generator advances (the next call samples anew)."""
    p = Pool([()] * engines)
    try:
        want, rows = expected()
        ro = p.pool.generate(0, PROMPTS, **GEN)
        assert ro.response_ids == want
        assert ro.prompt_index == [i for i in range(len(PROMPTS)) for _ in range(G)]
        assert ro.prompt_ids == PROMPTS and ro.policy_name == "fake"
        assert ro.finished_eos == [ids[-1] == EOS for ids in want]
        assert ro.truncated == [ids[-1] != EOS for ids in want]
        assert 0 < sum(ro.finished_eos) < len(want)           # both kinds occur
        calls = p.calls()
        assert sent_rows(calls) == sorted(rows)                # each row once
        # engine j got the j-th contiguous slice of prompts (5 over 3: 2, 2, 1)
        per_engine = {"1": [5], "2": [3, 2], "3": [2, 2, 1]}[str(engines)]
        assert sorted(t for t, _ in calls) == [str(j) for j in range(engines)]
        by_tag = dict(calls)
        start = 0
        for j, n in enumerate(per_engine):
            assert [r[0] for r in by_tag[str(j)]] == [10 + i for i in range(start, start + n)
                                                      for _ in range(G)]
            start += n
        want2, _ = expected(calls=2)
        assert p.pool.generate(0, PROMPTS, **GEN).response_ids == want2 != want
    finally:
        p.close()


def test_engine_dying_mid_call_is_restarted_and_its_shard_resent_once(cluster):
    """Engine 1 of 2 dies inside a generate: it is restarted, only its shard is re-sent
    (same seeds) and the result is the fault-free one; engine 0's shard is sent once."""
    p = Pool([(), ("die",)])
    try:
        want, rows = expected()
        ro = p.pool.generate(0, PROMPTS, **GEN)
        assert ro.response_ids == want
        assert p.pool.stats()["restarts"] == [[0, 1]] and p.pool.stats()["timeouts"] == [[0, 0]]
        calls = p.calls()
        assert sorted(t for t, _ in calls) == ["0", "1", "1r"]
        by_tag = dict(calls)
        assert by_tag["1r"] == by_tag["1"]                     # the same rows, same seeds
        assert sent_rows([c for c in calls if c[0] != "1"]) == sorted(rows)
    finally:
        p.close()


def test_engine_dying_past_the_budget_is_a_clear_error(cluster):
    """max_engine_restarts=1: the restarted engine dies again: an error naming the agent, the
    engine, the budget and the death, after exactly one restart; the agent's generator is left
    as before the call."""
    p = Pool([(), ("die",)], max_restarts=1, restart_faults=[("die",)])
    try:
        with pytest.raises(RuntimeError, match=r"^vLLM engine 1 of agent 0 \('fake'\) died and "
                                               r"has already been restarted 1 times "
                                               r"\(rollout.max_engine_restarts=1\): "
                                               r"ActorDiedError"):
            p.pool.generate(0, PROMPTS, **GEN)
        assert p.pool.restarts == [[0, 1]]
        assert sorted(t for t, _ in p.calls()) == ["0", "1", "1r"]
        # the failed call drew nothing from the agent's generator (as the Ray pool's)
        assert torch.equal(p.pool.generators[0].get_state(),
                           agent_generators(SEED, 1)[0].get_state())
    finally:
        p.close()


def test_hung_engine_is_killed_restarted_and_counted(cluster):
    """rollout.call_timeout_s=8: engine 0 never answers: after 8 s it is killed and restarted,
    its shard re-sent, the samples are the fault-free ones; one timeout and one restart."""
    p = Pool([("hang",), ()], call_timeout_s=8)
    try:
        want, _ = expected()
        t0 = time.monotonic()
        assert p.pool.generate(0, PROMPTS, **GEN).response_ids == want
        assert 8 <= time.monotonic() - t0 < 90
        assert p.pool.stats()["timeouts"] == [[1, 0]]
        assert p.pool.stats()["restarts"] == [[1, 0]]
        calls = p.calls()
        assert sorted(t for t, _ in calls) == ["0", "0r", "1"]
        assert dict(calls)["0r"] == dict(calls)["0"]
    finally:
        p.close()


def test_dead_vllm_worker_process_restarts_the_engine(cluster):
    """An engine whose vLLM worker process died (EngineDied, its actor alive) is restarted
    like a dead actor; the result is the fault-free one."""
    p = Pool([("engine_died",), ()])
    try:
        want, _ = expected()
        assert p.pool.generate(0, PROMPTS, **GEN).response_ids == want
        assert p.pool.stats()["restarts"] == [[1, 0]]
        assert sorted(t for t, _ in p.calls()) == ["0", "0r", "1"]
    finally:
        p.close()


@pytest.mark.parametrize("fault, message", [
    ("drop", r"^vLLM engines of agent 0 returned 14 samples, expected 15$"),
    ("short_lps", r"^vLLM returned an inconsistent sample \d+ for agent 'fake': "),
])
def test_an_engine_answer_that_does_not_add_up_is_an_error(cluster, fault, message):
    """A lost sample or a sample whose log-probs do not match its tokens is an error, not a
    rollout with a sample missing or misaligned (and not a restart); the agent's generator is
    left as before the call."""
    p = Pool([(), (fault,)])
    try:
        with pytest.raises(RuntimeError, match=message):
            p.pool.generate(0, PROMPTS, **GEN)
        assert p.pool.restarts == [[0, 0]]
        assert torch.equal(p.pool.generators[0].get_state(),      # nothing drawn
                           agent_generators(SEED, 1)[0].get_state())
    finally:
        p.close()


def test_weight_sync_bumps_the_version_every_request_names(cluster):
    """Each load is the agent's next version; generate requests name it, so an engine that
    missed a load (here: one that still holds version 0) is an error naming it, never a
    sample from stale weights."""
    p = Pool([(), ()])
    try:
        p.pool._load(0, [{"w": torch.ones(1)}])
        assert p.pool.stats()["versions"] == [1]
        assert p.pool.generate(0, PROMPTS, **GEN).num_samples == len(PROMPTS) * G
        p.pool._load(0, [{"w": torch.ones(1)}])
        assert p.pool.stats()["versions"] == [2]
        stale = p._engine("stale", ())
        p.ray.get(stale.load_weights.remote(None, version=1))   # missed the last load
        p.pool.actors[0][1] = stale
        with pytest.raises(RuntimeError, match=r"^vLLM engine 1 of agent 0 \('fake'\): generate "
                                               r"failed: RuntimeError: vLLM engine holds "
                                               r"weights version 1, the request needs version "
                                               r"2$"):
            p.pool.generate(0, PROMPTS, **GEN)
        assert p.pool.restarts == [[0, 0]]
    finally:
        p.close()
