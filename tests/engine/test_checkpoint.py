"""hacpo.engine.checkpoint.load unpickles with weights_only=True: a file holding other Python
objects (one that would run code when unpickled) is refused with an error naming the file and
the variable that allows it; the checkpoints hacpo writes load that way."""
import os

import numpy as np
import pytest
import torch

from hacpo.engine import checkpoint as ckpt


class _RunsCode:
    """Unpickling this calls os.system (what a malicious checkpoint would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Plain:
    def __init__(self, value):
        self.value = value


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(ckpt.TRUST_ENV, raising=False)
    marker = tmp_path / "PWNED"
    path = str(tmp_path / "checkpoint.pt")
    torch.save({"step": 1, "x": _RunsCode(marker)}, path)
    with pytest.raises(RuntimeError, match=rf"checkpoint {path} holds Python objects other than "
                                           rf"tensors .*set {ckpt.TRUST_ENV}=1"):
        ckpt.load(path)
    assert not marker.exists(), "the payload ran"
    # an object of a class no library allowlists (numpy arrays, what older checkpoints held,
    # may be allowlisted by another import, e.g. megatron-core's): refused, loads when trusted
    torch.save({"a": _Plain(3)}, path)
    with pytest.raises(RuntimeError, match="holds Python objects other than tensors"):
        ckpt.load(path)
    monkeypatch.setenv(ckpt.TRUST_ENV, "1")
    assert ckpt.load(path)["a"].value == 3


def test_garbage_is_cannot_be_read(tmp_path, monkeypatch):
    monkeypatch.delenv(ckpt.TRUST_ENV, raising=False)
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match=rf"checkpoint {path} cannot be read"):
        ckpt.load(str(path))
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        ckpt.load(str(tmp_path / "missing.pt"))


def test_plain_state_round_trips(tmp_path, monkeypatch):
    """What trainer._save writes: tensors, numbers, strings, None, lists, dicts, generator
    states (the ratio logs as tensors)."""
    monkeypatch.delenv(ckpt.TRUST_ENV, raising=False)
    state = {"step": 3, "fingerprint": {"a": [1, 2.5, "x", None, True]},
             "shuffle_gen": torch.Generator().manual_seed(0).get_state(),
             "ratio_log": {"a/self": torch.from_numpy(np.linspace(0, 1, 5))}}
    path = str(tmp_path / "c.pt")
    ckpt.save_atomic(state, path)
    got = ckpt.load(path)
    assert got["fingerprint"] == state["fingerprint"] and got["step"] == 3
    assert torch.equal(got["shuffle_gen"], state["shuffle_gen"])
    assert torch.equal(got["ratio_log"]["a/self"], state["ratio_log"]["a/self"])
