"""A real vLLM engine serving a bfloat16 policy. vLLM's CPU attention runs AMX instructions for
bfloat16 without asking Linux for permission: on a CPU with AMX the engine died at start-up
(SIGILL, which Ray reported as a worker perhaps OOM-killed) until the worker asked for it
(``_allow_amx`` in hacpo/launch/_vllm_worker.py). On a CPU without AMX it passes either way."""
import dataclasses
import math

import pytest

from hacpo.launch.vllm_rollout import VLLMRolloutEngine

from .conftest import QUESTIONS, build_policies, tiny_policy_configs, vllm_config

pytestmark = pytest.mark.slow


def test_bfloat16_policy_engine_starts_and_samples():
    configs = [dataclasses.replace(tiny_policy_configs()[0], dtype="bfloat16")]
    pol, = build_policies(configs)
    assert str(pol.output_weight.dtype) == "torch.bfloat16"
    engine = VLLMRolloutEngine([pol], vllm_config(configs))
    try:
        prompts = [pol.tokenizer.prompt_ids(q) for q in QUESTIONS[:2]]
        ro = engine.generate(0, prompts, num_samples=2, max_new_tokens=6, temperature=1.0,
                             top_p=1.0)
        assert ro.num_samples == 4
        got = [x for row in ro.sampler_logprobs for x in row]
        assert got and all(math.isfinite(x) and x <= 0 for x in got)
        # the policy's own log-probs, within bfloat16's rounding (seen: 0.11)
        lp, mask = pol.response_logprobs(ro.sample_prompts(), ro.response_ids)
        assert max(abs(a - b) for a, b in zip(lp[mask].float().tolist(), got)) < 0.5
    finally:
        engine.close()
