"""VLLMWorker's per-load weight check against the recording stand-in for vLLM's ``LLM``
(tests/vllm/test_vllm_devices.py; no vLLM, instant): a tensor sent twice or one never sent is
an error naming it, and the engine then serves nothing until a load succeeds. The same checks
against a real engine are in test_vllm_weight_checks.py (slow)."""
import pytest
import torch

from .test_vllm_devices import _gen, fake_vllm  # noqa: F401  (fixture)


def test_twice_sent_or_missing_weight_is_an_error_naming_it(fake_vllm):
    fake_vllm("cpu")
    from hacpo.launch._vllm_worker import VLLMWorker

    w = VLLMWorker({"architectures": ["LlamaForCausalLM"]},
                   [{"w": torch.ones(2)}, {"b": torch.ones(1)}], dtype="float32",
                   max_model_len=64, seed=0, version=0, shapes={"w": (2,), "b": (1,)})
    with pytest.raises(RuntimeError, match=r"^weight load for vLLM: weights missing: \['b'\]$"):
        w.load_weights([{"w": torch.ones(2)}], version=1)
    with pytest.raises(RuntimeError, match=r"holds weights version -1"):
        _gen(w, 1)
    with pytest.raises(RuntimeError, match=r"^weight load for vLLM: weight 'w' \(2,\) does not "
                                           r"fit: sent twice$"):
        w.load_weights([{"w": torch.ones(2)}, {"w": torch.ones(2), "b": torch.ones(1)}],
                       version=2)
    with pytest.raises(RuntimeError, match=r"holds weights version -1"):
        _gen(w, 2)
    w.load_weights([{"w": torch.full((2,), 2.0)}, {"b": torch.ones(1)}], version=3)
    assert _gen(w, 3) == -5.0
