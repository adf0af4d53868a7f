"""vLLM engines on a GPU (``rollout.device=cuda``), disaggregated and colocated (sleep / wake).

Needs a GPU and a CUDA build of vLLM in the engines' Python (``$HACPO_VLLM_PYTHON`` or
.venv-vllm); skipped without a GPU. The CPU tests of the same code paths are
tests/vllm/test_vllm_devices.py.
"""
import pytest
import torch

from .conftest import (QUESTIONS, build_policies, expected_logprobs, max_abs_diff,
                       tiny_policy_configs, vllm_config)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a GPU (and a CUDA build of vLLM for the engines)")]
TOL = 1e-2    # float32 weights; GPU matmuls may use TF32


def _generate(engine, k, prompts):
    return engine.generate(k, prompts, num_samples=4, max_new_tokens=12, temperature=1.0,
                           top_p=1.0)


def test_cuda_engine_generates_sleeps_wakes_and_syncs():
    import ray
    from ray.util.placement_group import placement_group

    from hacpo.launch.ray_cluster import connect
    from hacpo.launch.vllm_rollout import VLLMRolloutEngine

    cluster = connect("")
    try:
        configs = tiny_policy_configs()[:1]
        policies = build_policies(configs)
        pol = policies[0]
        prompts = [pol.tokenizer.prompt_ids(q) for q in QUESTIONS]
        # disaggregated: one GPU of its own
        engine = VLLMRolloutEngine(policies, vllm_config(configs, device="cuda",
                                                         gpu_memory_utilization=0.3))
        try:
            env = ray.get(engine.actors[0][0].info.remote())
            ro = _generate(engine, 0, prompts)
            want, _ = expected_logprobs(pol, ro.sample_prompts(), ro.response_ids,
                                        temperature=1.0, top_p=1.0)
            assert max_abs_diff(ro.sampler_logprobs, want) < TOL, env
            engine.idle()                            # no-op: not colocated
        finally:
            engine.close()
        # colocated: the engine in a bundle it would share with a trainer rank, with sleep mode
        # (placement given here directly; in a run it is the megatron group's bundle)
        pg = placement_group([{"CPU": 1, "GPU": 1}])
        ray.get(pg.ready(), timeout=120)
        cfg = vllm_config(configs, device="cuda", gpu_memory_utilization=0.3)
        cfg.rollout.colocate = True
        engine = VLLMRolloutEngine(policies, cfg, placement=[[(pg, 0)]])
        try:
            state = engine.state_dict()
            first = _generate(engine, 0, prompts)
            engine.idle()                            # level-2 sleep: weights discarded
            engine.load_state_dict(state)
            again = _generate(engine, 0, prompts)    # woken with the same weights
            assert again.response_ids == first.response_ids
            assert max_abs_diff(again.sampler_logprobs, first.sampler_logprobs) < 1e-4
            with torch.no_grad():                    # a "training step" while it sleeps
                for p in pol.model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            engine.idle()
            engine.sync_weights(0)                   # wakes its weights with the new ones
            ro = _generate(engine, 0, prompts)
            want, _ = expected_logprobs(pol, ro.sample_prompts(), ro.response_ids,
                                        temperature=1.0, top_p=1.0)
            assert max_abs_diff(ro.sampler_logprobs, want) < TOL
            now, _ = expected_logprobs(pol, first.sample_prompts(), first.response_ids,
                                       temperature=1.0, top_p=1.0)
            assert max_abs_diff(now, first.sampler_logprobs) > 10 * TOL   # weights moved
        finally:
            engine.close()
    finally:
        cluster.shutdown()
