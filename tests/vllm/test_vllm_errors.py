"""Bad input to the vLLM rollout engine: clear errors before any engine or Ray cluster starts."""
import os
import sys

import pytest

from hacpo.launch import vllm_rollout
from hacpo.launch.vllm_rollout import VLLMRolloutEngine

from .conftest import build_policies, tiny_policy_configs, vllm_config


def test_decoder_policy_is_a_clear_error():
    from hacpo.models.policy import PolicyConfig, build_policy

    configs = [tiny_policy_configs()[0], PolicyConfig(name="plain", kind="decoder")]
    policies = [build_policy(configs[0]), build_policy(configs[1])]
    cfg = vllm_config(configs)
    with pytest.raises(ValueError, match=r"agent 1 \('plain'\) is kind 'decoder'"):
        cfg.check_runnable()             # what train and the launchers check before any work
    with pytest.raises(ValueError, match=r"agent 1 \('plain'\) is kind 'decoder'"):
        VLLMRolloutEngine(policies, vllm_config(configs[:1]))   # policies built by hand


def test_missing_vllm_venv_is_a_clear_error(monkeypatch, tmp_path):
    import ray

    configs = tiny_policy_configs()[:1]
    policies = build_policies(configs)
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    monkeypatch.setenv(vllm_rollout.VLLM_PYTHON_ENV, missing)
    connected = ray.is_initialized()
    with pytest.raises(FileNotFoundError, match=r"no vLLM Python at .*no-venv.*make vllm-venv"):
        VLLMRolloutEngine(policies, vllm_config(configs))
    assert ray.is_initialized() == connected    # failed before touching Ray
    # a Python without vllm: also named, with the same hint
    monkeypatch.setenv(vllm_rollout.VLLM_PYTHON_ENV, sys.executable)
    with pytest.raises(RuntimeError, match=r"has no vllm installed.*make vllm-venv"):
        VLLMRolloutEngine(policies, vllm_config(configs))


def test_default_vllm_python_is_the_repo_venv(monkeypatch):
    monkeypatch.delenv(vllm_rollout.VLLM_PYTHON_ENV, raising=False)
    assert vllm_rollout.DEFAULT_VLLM_PYTHON == \
        vllm_rollout.REPO_ROOT / ".venv-vllm" / "bin" / "python"
    assert vllm_rollout.vllm_python() == str(vllm_rollout.DEFAULT_VLLM_PYTHON)
    assert os.path.isfile(vllm_rollout.DEFAULT_VLLM_PYTHON)


@pytest.mark.parametrize("temperature", [0.005, 1e-6, 2.5])
def test_temperature_vllm_cannot_serve_is_a_clear_error(temperature):
    """vLLM raises a temperature in (0, 0.01) to 0.01 (another distribution than the trainer
    scores) and rejects one above 2: refused before any engine or Ray cluster starts."""
    import ray

    configs = tiny_policy_configs()[:1]
    policies = build_policies(configs)
    connected = ray.is_initialized()
    with pytest.raises(ValueError, match=rf"rollout.temperature={temperature!r} cannot be "
                                         rf"served.*\[0.01, 2\]"):
        VLLMRolloutEngine(policies, vllm_config(configs, temperature=temperature))
    assert ray.is_initialized() == connected
    with pytest.raises(ValueError, match=rf"rollout.temperature={temperature!r} cannot be "
                                         rf"served"):
        vllm_config(configs, temperature=temperature).check_runnable()  # train, launchers
    for ok in (0.0, 0.01, 1.0, 2.0):
        vllm_rollout.check_vllm_temperature(ok)


@pytest.mark.parametrize("engine_tp, heads, kv_heads, bad", [
    (3, 2, 1, "2 attention heads"),           # tiny Qwen2: 2 heads, 1 KV head
    (4, 12, 3, "3 KV heads"),                 # fewer KV heads than workers, not dividing 4
    (2, 6, 3, "3 KV heads"),                  # more KV heads than workers, not divisible
])
def test_heads_engine_tp_cannot_split_is_a_clear_error(engine_tp, heads, kv_heads, bad,
                                                       tmp_path):
    """Heads that vLLM cannot split over rollout.engine_tp workers: refused naming the agent,
    the heads and the key, before any engine or Ray cluster starts (vLLM's own error came
    from inside the engine's start-up, after it had started, or as a worker's assertion);
    from the config alone too (check_runnable: `hacpo train` and the launchers, before a job
    is submitted), for hf_config sizes and for a checkpoint directory's config.json."""
    import dataclasses
    import json

    import ray

    from .conftest import HF_TINY

    base = tiny_policy_configs()[1]
    configs = [dataclasses.replace(base, hf_config={
        **HF_TINY, "hidden_size": 64 * heads, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads})]
    policies = build_policies(configs)
    connected = ray.is_initialized()
    with pytest.raises(ValueError, match=rf"rollout.engine_tp={engine_tp}: agent 0 "
                                         rf"\('qwen2-bpe'\) has {bad}, which vLLM cannot split "
                                         rf"over {engine_tp} tensor-parallel workers"):
        VLLMRolloutEngine(policies, vllm_config(configs, engine_tp=engine_tp))
    assert ray.is_initialized() == connected    # failed before touching Ray
    ckpt_dir = tmp_path / "model"
    ckpt_dir.mkdir()
    (ckpt_dir / "config.json").write_text(json.dumps(
        {"model_type": "qwen2", "num_attention_heads": heads, "num_key_value_heads": kv_heads}))
    for cfg in (configs[0], dataclasses.replace(base, path=str(ckpt_dir), hf_config={})):
        with pytest.raises(ValueError, match=rf"rollout.engine_tp={engine_tp}: agent 0 "
                                             rf"\('qwen2-bpe'\) has {bad}, which vLLM cannot "
                                             rf"split"):
            vllm_config([cfg], engine_tp=engine_tp).check_runnable()


def test_heads_that_split_pass_the_engine_tp_check():
    """The check refuses only what vLLM cannot split: KV heads fewer than the workers that
    divide engine_tp are replicated, and engine_tp=1 splits nothing."""
    from types import SimpleNamespace

    def pol(heads, kv):
        return SimpleNamespace(name="p", model=SimpleNamespace(config=SimpleNamespace(
            num_attention_heads=heads, num_key_value_heads=kv)))

    for tp, heads, kv in ((2, 2, 1), (4, 8, 2), (2, 4, 4), (4, 4, None), (1, 3, 3)):
        vllm_rollout.check_engine_tp([pol(heads, kv)], tp)
    # the config check passes them too (tiny Qwen2 of tiny_policy_configs: 2 heads, 1 KV head)
    vllm_config(tiny_policy_configs(), engine_tp=2).check_runnable()
