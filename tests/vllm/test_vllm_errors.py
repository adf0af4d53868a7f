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


def test_missing_vllm_python_fails_hacpo_train_before_any_work(monkeypatch, tmp_path, capsys):
    """No vLLM Python (no .venv-vllm, $HACPO_VLLM_PYTHON naming a missing file): `hacpo train`
    refuses in one line, exit 2, before the warm-up or the run dir (check_runnable; it was a
    traceback after the warm-up, with config.json written)."""
    import json

    from hacpo.launch.cli import main

    missing = str(tmp_path / "no-venv" / "bin" / "python")
    monkeypatch.setenv(vllm_rollout.VLLM_PYTHON_ENV, missing)
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    cfg = vllm_config(tiny_policy_configs()[:1]).to_dict()
    cfg.update(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"))
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match=r"no vLLM Python at .*no-venv.*make vllm-venv"):
        vllm_config(tiny_policy_configs()[:1]).check_runnable()
    assert main(["train", "--config", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hacpo train: error: rollout.engine='vllm': no vLLM Python at "
                          f"{missing!r}; build it with `make vllm-venv`"), err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_kv_cache_is_sized_for_max_model_len():
    """The CPU KV cache (VLLM_CPU_KVCACHE_SPACE, whole GiB) holds one request of the policy's
    max_len with a margin, at least 1 GiB: the fixed 1 GiB refused a long-context model
    ("1.43 GiB KV cache is needed": 2 layers x K,V x 1 KV head x 64 x float32 x 1.5M)."""
    tiny = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "hidden_size": 128}
    gib = vllm_rollout.kv_cache_gib
    assert gib(tiny, "float32", 256) == 1
    assert gib(tiny, "float32", 1_500_000) == 2           # 1.43 GiB x 1.25 margin
    assert gib(tiny, "bfloat16", 1_500_000) == 1          # half the bytes
    assert gib(tiny, "float32", 4_000_000) == 5           # 3.81 GiB x 1.25 = 4.77
    # no num_key_value_heads: every head has its own K and V; an explicit head_dim wins
    assert gib({**tiny, "num_key_value_heads": None}, "float32", 1_500_000) == 4
    assert gib({**tiny, "head_dim": 128}, "float32", 1_500_000) == 4
    # a Qwen2.5-7B-like model at 128k tokens in bfloat16: 28 x 2 x 4 x 128 x 2 x 131072 = 7 GiB
    big = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
           "hidden_size": 3584}
    assert gib(big, "bfloat16", 131072) == 9


def test_user_set_kv_cache_space_is_kept(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert vllm_rollout._actor_env(1, None, 3)["VLLM_CPU_KVCACHE_SPACE"] == "3"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    assert vllm_rollout._actor_env(1, None, 3)["VLLM_CPU_KVCACHE_SPACE"] == "7"


def test_kv_cache_refusal_names_the_variable(monkeypatch):
    """vLLM's "KV cache is needed ... Try increasing `gpu_memory_utilization` ... or
    decreasing `max_model_len`" (neither applies on the CPU) becomes an error naming
    VLLM_CPU_KVCACHE_SPACE; other errors, and CUDA engines, are left as they are."""
    from hacpo.launch._vllm_worker import kv_cache_error

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    vllm_msg = ("To serve at least one request with the model's max seq len (1500000), (1.43 "
                "GiB KV cache is needed, which is larger than the available KV cache memory "
                "(1.0 GiB). Try increasing `gpu_memory_utilization` ...")
    e = kv_cache_error(ValueError(vllm_msg), "cpu", 1_500_000)
    assert isinstance(e, ValueError)
    assert str(e).startswith("vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE='1' GiB) is too small "
                             "for max_model_len=1500000 (the policy's max_len): set "
                             "VLLM_CPU_KVCACHE_SPACE to more GiB (vLLM: To serve"), str(e)
    assert kv_cache_error(ValueError("No available memory for the cache blocks."), "cpu", 9)
    assert kv_cache_error(ValueError(vllm_msg), "cuda", 1_500_000) is None
    assert kv_cache_error(ValueError("head size 16 is not supported"), "cpu", 256) is None
    # vLLM's own message naming the variable (more than the node's memory) stays as it is
    assert kv_cache_error(ValueError("Available memory ... less than requested memory for kv "
                                     "... Decrease VLLM_CPU_KVCACHE_SPACE"), "cpu", 9) is None


def test_engine_past_its_restart_budget_says_resume(tmp_path, monkeypatch):
    """The error that ends a run whose engine died past rollout.max_engine_restarts ends with
    the next step, as a stopped run's does, where there is a run to continue (config.json)."""
    import types

    import ray
    # (a real ray.kill of the stand-in actor started a default 2-CPU Ray cluster in this
    # process, which later modules reused: tests/conftest.py named this module for it)
    monkeypatch.setattr(ray, "kill", lambda *a, **k: None)
    connected = ray.is_initialized()
    pool = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    pool.policies, pool.actors = [types.SimpleNamespace(name="llama")], [[object()]]
    pool.max_restarts, pool.restarts, pool.timeouts = 1, [[1]], [[0]]
    pool.call_timeout_s = 5
    pool.run_dir = str(tmp_path)
    for hung in (None, "generate"):
        with pytest.raises(RuntimeError, match=r"max_engine_restarts=1\).*; continue the run "
                                               r"with --resume \(rollout.max_engine_restarts "
                                               r"may be raised for it\)$") as e:
            (tmp_path / "config.json").write_text("{}")
            pool._restart(0, 0, RuntimeError("engine killed"), hung=hung)
        assert "--resume" not in str(e.value).partition("; continue")[0]
        (tmp_path / "config.json").unlink()     # no run to continue: no hint
        with pytest.raises(RuntimeError) as e:
            pool._restart(0, 0, RuntimeError("engine killed"), hung=hung)
        assert "--resume" not in str(e.value)
    assert ray.is_initialized() == connected          # no Ray cluster started here
