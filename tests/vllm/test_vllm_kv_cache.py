"""A real vLLM engine for a policy whose max_len needs more than 1 GiB of CPU KV cache (vLLM
refuses to start without room for one request of max_model_len tokens): the cache is sized
from the model (it was a fixed 1 GiB, and vLLM's advice, gpu_memory_utilization or a lower
max_model_len, does not apply); a VLLM_CPU_KVCACHE_SPACE the user set is kept, and vLLM's
refusal then names it."""
import pytest

from hacpo.launch.vllm_rollout import VLLMRolloutEngine
from hacpo.models.policy import PolicyConfig

from .conftest import HF_TINY, build_policies, vllm_config

pytestmark = pytest.mark.slow


def test_long_context_engine_gets_the_kv_cache_it_needs(monkeypatch):
    # 2 layers x K,V x 1 KV head x 64 x float32 x 1.2M tokens = 1.14 GiB (sized: 2 GiB)
    configs = [PolicyConfig(name="long", kind="hf", arch="llama", tokenizer="char",
                            hf_config=dict(HF_TINY, max_position_embeddings=1_200_000), seed=7)]
    pol, = build_policies(configs)
    assert pol.max_len == 1_200_000
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    with pytest.raises(RuntimeError, match=r"failed to start(.|\n)*ValueError: vLLM's CPU KV "
                                           r"cache \(VLLM_CPU_KVCACHE_SPACE='1' GiB\) is too "
                                           r"small for max_model_len=1200000"):
        VLLMRolloutEngine([pol], vllm_config(configs))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    engine = VLLMRolloutEngine([pol], vllm_config(configs))
    try:
        ro = engine.generate(0, [pol.tokenizer.prompt_ids("hi")], num_samples=2,
                             max_new_tokens=4, temperature=1.0, top_p=1.0)
        assert ro.num_samples == 2
    finally:
        engine.close()
