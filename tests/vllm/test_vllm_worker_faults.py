"""The vLLM worker's fault paths against a recording stand-in for vLLM's ``LLM`` (no vLLM
needed; the real engine's are in test_vllm_tp.py and test_vllm_weight_checks.py, slow): a call
that fails because one of vLLM's worker processes died is :class:`EngineDied` naming the dead
process (the pool restarts the engine on it, and on nothing else), an answer whose log-probs
do not match its tokens is an error, and a weight load that fails
part-way ends the reload it began, so the next load starts a fresh one and serves its weights."""
import types

import pytest
import torch

from hacpo.launch._vllm_worker import EngineDied

from .test_vllm_devices import RecordingLLM, _gen, _worker, fake_vllm  # noqa: F401


def _proc(name, exitcode):
    return types.SimpleNamespace(proc=types.SimpleNamespace(
        name=name, exitcode=exitcode, is_alive=lambda: exitcode is None))


class DyingLLM(RecordingLLM):
    """generate and collective_rpc fail as vLLM's do once its executor is shut down; ``failed`` is what vLLM's
    multiprocessing executor says (``is_failed``) and which of its processes are alive."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.error: Exception | None = None
        executor = types.SimpleNamespace(is_failed=False,
                                         workers=[_proc("VllmWorker-0", None),
                                                  _proc("VllmWorker-1", None)])
        self.llm_engine = types.SimpleNamespace(model_executor=executor)

    def generate(self, prompts, params, use_tqdm=False):
        if self.error is not None:
            raise self.error
        return super().generate(prompts, params, use_tqdm)

    def collective_rpc(self, method, args=()):
        if self.error is not None:
            raise self.error
        return super().collective_rpc(method, args)


def test_dead_vllm_worker_process_is_engine_died_naming_it(fake_vllm, monkeypatch):
    import sys

    monkeypatch.setattr(sys.modules["vllm"], "LLM", DyingLLM)
    fake_vllm("cpu")
    w = _worker(device="cpu")
    llm = w.llm
    llm.error = RuntimeError("cancelled")
    # executor working: the call's own error, as it is (the pool does not restart on it)
    with pytest.raises(RuntimeError, match="^cancelled$") as e:
        _gen(w, 0)
    assert not isinstance(e.value, EngineDied)
    # TP rank 1's process killed, vLLM shut its executor down: EngineDied naming it, only it
    llm.llm_engine.model_executor = types.SimpleNamespace(
        is_failed=True, workers=[_proc("VllmWorker-0", None), _proc("VllmWorker-1", -9)])
    with pytest.raises(EngineDied, match=r"worker process\(es\) VllmWorker-1 \(exit code -9\) "
                                         r"died.*failed with RuntimeError: cancelled") as e:
        _gen(w, 0)
    assert "VllmWorker-0" not in str(e.value)
    # failed, but no process of it seen dead (yet): still EngineDied, the process unknown
    llm.llm_engine.model_executor = types.SimpleNamespace(
        is_failed=True, workers=[_proc("VllmWorker-0", None), _proc("VllmWorker-1", None)])
    with pytest.raises(EngineDied, match=r"worker process\(es\) unknown died"):
        _gen(w, 0)
    llm.llm_engine.model_executor.workers[1] = _proc("VllmWorker-1", -9)
    with pytest.raises(EngineDied, match="VllmWorker-1"):       # a weight load too
        w.load_weights({"w": torch.ones(2)}, version=1)


class StrictReloadLLM(RecordingLLM):
    """As vLLM's layerwise reload: a reload cannot begin while one is still under way."""

    def collective_rpc(self, method, args=()):
        from hacpo.launch import _vllm_worker as w

        if method is w._reload_begin:
            if getattr(self, "_reloading", False):
                raise RuntimeError("layerwise reload already initialized")
            self._reloading = True
        elif method is w._reload_end:
            self._reloading = False
        return super().collective_rpc(method, args)


def test_failed_load_ends_its_reload_and_the_next_load_serves_its_weights(fake_vllm,
                                                                          monkeypatch):
    import sys

    monkeypatch.setattr(sys.modules["vllm"], "LLM", StrictReloadLLM)
    fake_vllm("cpu")
    w = _worker(device="cpu", shapes={"w": (2,)})
    assert _gen(w, 0) == -2.0                     # the start's weights: ones(2)
    for bad in ({"w": torch.ones(3)}, {"w": torch.ones(2), "v": torch.ones(1)},
                [{"w": torch.ones(2)}, {"w": torch.ones(2)}], {}):
        with pytest.raises(RuntimeError, match="weight load for vLLM"):
            w.load_weights(bad, version=1)
        assert not w.llm._reloading, bad          # the reload it began was ended
        with pytest.raises(RuntimeError, match="holds weights version -1"):
            _gen(w, 0)                            # nothing half-loaded is served
    assert w.load_weights({"w": torch.full((2,), 3.0)}, version=2) == 1
    assert _gen(w, 2) == -6.0


class ShortLogprobsLLM(RecordingLLM):
    """Answers one log-prob entry fewer than the tokens it returns (or none at all)."""
    entries = 1

    def generate(self, prompts, params, use_tqdm=False):
        outs = super().generate(prompts, params, use_tqdm)
        for o in outs:
            c, = o.outputs
            c.token_ids = [1, 1]
            c.logprobs = None if self.entries is None else c.logprobs[:self.entries]
        return outs


def test_logprobs_that_do_not_match_the_tokens_are_an_error(fake_vllm, monkeypatch):
    import sys

    monkeypatch.setattr(sys.modules["vllm"], "LLM", ShortLogprobsLLM)
    fake_vllm("cpu")
    w = _worker(device="cpu")
    with pytest.raises(RuntimeError, match="vLLM returned 2 tokens but 1 log-prob entries"):
        _gen(w, 0)
    w.llm.entries = None
    with pytest.raises(RuntimeError, match="vLLM returned 2 tokens but None log-prob entries"):
        _gen(w, 0)
