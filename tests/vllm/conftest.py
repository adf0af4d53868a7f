"""Shared helpers for the vLLM rollout engine tests: tiny HF policies vLLM can serve (head_dim
64: vLLM's CPU attention rejects 16), and the exact log-probs a sampler should report."""
import pytest
import torch

import hacpo.launch.ray_cluster  # noqa: F401  (before ray: a private cluster binds to loopback)
from hacpo.engine.run_config import AgentConfig, RolloutConfig, TrainConfig
from hacpo.models.policy import PolicyConfig, build_policy

# initializer_range 0.2: peaked next-token distributions (log-probs spread over several nats,
# EOS ends some samples and not others), so a wrong weight or token shows up clearly.
HF_TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256,
           "initializer_range": 0.2}
QUESTIONS = ["What is 3 + 4?", "Add 10 and 5.", "Tom has 2 apples and buys 9 more.", "hi"]


def tiny_policy_configs():
    """Two agents that differ in architecture and tokenizer: Llama + the char tokenizer,
    Qwen2 (q/k/v biases) + the Qwen3 BPE with a reduced vocabulary."""
    return [PolicyConfig(name="llama-char", kind="hf", arch="llama", tokenizer="char",
                         hf_config=HF_TINY, seed=3),
            PolicyConfig(name="qwen2-bpe", kind="hf", arch="qwen2", tokenizer="qwen3",
                         reduce_vocab=True, hf_config=HF_TINY, seed=4)]


def build_policies(configs):
    return [build_policy(c, corpus=QUESTIONS if c.reduce_vocab else None) for c in configs]


def vllm_config(configs, **rollout) -> TrainConfig:
    return TrainConfig(agents=[AgentConfig(policy=c) for c in configs],
                       rollout=RolloutConfig(engine="vllm", **rollout), seed=0, threads=1)


def expected_logprobs(policy, prompts, responses, *, temperature: float, top_p: float):
    """Per-token log-probs of ``responses`` under the distribution ``generate`` samples from
    (temperature, then top-p renormalization; plain softmax for greedy), from one teacher-
    forced forward pass per sample. Also returns whether each token was the argmax."""
    out, is_argmax = [], []
    V = policy.tokenizer.vocab_size
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            ids = torch.tensor([list(p) + list(r)])
            logits = policy.forward_logits(ids, torch.ones_like(ids, dtype=torch.bool))[0]
            logits = logits[len(p) - 1:len(p) - 1 + len(r), :V].float()
            tgt = torch.tensor(r)
            is_argmax.append((logits.argmax(-1) == tgt).tolist())
            if temperature == 0:
                out.append(torch.log_softmax(logits, -1).gather(-1, tgt[:, None])[:, 0].tolist())
                continue
            probs = torch.softmax(logits / temperature, -1)
            if top_p < 1:
                sp, order = probs.sort(-1, descending=True)
                keep = (sp.cumsum(-1) - sp) < top_p
                keep[:, 0] = True
                probs = probs * torch.zeros_like(keep).scatter(-1, order, keep)
                probs = probs / probs.sum(-1, keepdim=True)
            out.append(probs.gather(-1, tgt[:, None])[:, 0].log().tolist())
    return out, is_argmax


def check_sampled_logprobs(ro, policy, tol: float) -> None:
    """The engine's sampled log-probs (temperature 1, top-p 1) equal the policy's exact
    distribution and the trainer's teacher-forced path (hacpo.kernels) within ``tol``, and
    are spread out (over 2 nats) so that the tolerance can fail."""
    want, _ = expected_logprobs(policy, ro.sample_prompts(), ro.response_ids, temperature=1.0,
                                top_p=1.0)
    assert max_abs_diff(ro.sampler_logprobs, want) < tol
    lp, mask = policy.response_logprobs(ro.sample_prompts(), ro.response_ids)
    got = torch.tensor([x for row in ro.sampler_logprobs for x in row])
    assert (lp[mask] - got).abs().max().item() < tol
    assert got.max() - got.min() > 2.0


def max_abs_diff(a, b) -> float:
    flat_a = [x for row in a for x in row]
    flat_b = [x for row in b for x in row]
    assert len(flat_a) == len(flat_b) and flat_a
    return max(abs(x - y) for x, y in zip(flat_a, flat_b))


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def cluster():
    """A private Ray cluster (2 CPUs, loopback) for one test module's stand-in engines."""
    c = hacpo.launch.ray_cluster.connect("", num_cpus=2)
    try:
        yield c
    finally:
        c.shutdown()
