"""hacpo.engine.checkpoint.load unpickles with weights_only=True: a file holding other Python
objects (one that would run code when unpickled) is refused with an error naming the file and
the variable that allows it; the checkpoints hacpo writes load that way."""
import contextlib
import os

import numpy as np
import pytest
import torch

from hacpo.engine import checkpoint as ckpt

from ._locks import held_lock


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
    with pytest.raises(RuntimeError, match=rf"checkpoint {path} cannot be read") as e:
        ckpt.load(str(path))
    assert "weights_only" not in str(e.value)      # torch's unsafe advice is not repeated
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


_SLOW_SAVER = r"""
import sys, time
from hacpo.engine import checkpoint as ckpt

class Slow:                      # pickling it stalls the save after the temp file exists
    def __reduce__(self):
        time.sleep(120)
        return (int, (0,))

ckpt.save_atomic({"big": bytes(1 << 20), "slow": Slow()}, sys.argv[1])
"""


def test_a_writer_killed_mid_save_leaves_a_temp_file_the_next_save_removes(tmp_path, caplog):
    """kill -9 during a save leaves the old checkpoint and a temp file; the next save of that
    path removes every dead writer's temp file (this host's, another host's on a shared
    filesystem) and keeps a live writer's, even one whose pid means nothing here (another PID
    namespace with the same hostname: judged by the lock it holds, not by its pid)."""
    import signal
    import subprocess
    import sys
    import time
    path = str(tmp_path / "checkpoint.pt")
    ckpt.save_atomic({"step": 1}, path)
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_SAVER, path])
    host = os.uname().nodename
    live = tmp_path / f".tmp-checkpoint.pt.{host}.999999999.abc"     # no such pid here
    with held_lock(live), contextlib.ExitStack() as stack:
        stack.callback(lambda: proc.poll() is None and (proc.kill(), proc.wait()))
        deadline = time.monotonic() + 60
        while not [n for n in os.listdir(tmp_path)
                   if n.startswith(f".tmp-checkpoint.pt.{host}.{proc.pid}.")]:
            assert proc.poll() is None and time.monotonic() < deadline, "no saver"
            time.sleep(0.1)
        time.sleep(0.5)
        other_host = tmp_path / ".tmp-checkpoint.pt.some-other-host.1234567.abc"
        other_file = tmp_path / f".tmp-other.pt.{host}.{proc.pid}.abc"
        for p in (other_host, other_file):
            p.write_bytes(b"x")
        # while the saver runs, its temp file is locked: a save now keeps it
        ckpt.save_atomic({"step": 1}, path)
        assert [n for n in os.listdir(tmp_path) if f".{proc.pid}." in n and
                n.startswith(".tmp-checkpoint.pt.")]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        dead = [n for n in os.listdir(tmp_path) if n.startswith(".tmp-checkpoint.pt.") and
                f".{proc.pid}." in n]
        assert len(dead) == 1, os.listdir(tmp_path)
        assert ckpt.load(path)["step"] == 1          # the killed save changed nothing
        # a file modified in the last FRESH_S seconds is kept whatever its lock (a writer
        # between creating and locking it); age the others past that
        fresh = tmp_path / ".tmp-checkpoint.pt.yet-another-host.77.abc"
        fresh.write_bytes(b"x")
        old = time.time() - 2 * ckpt.FRESH_S
        for name in (dead[0], live.name, other_host.name):
            os.utime(tmp_path / name, (old, old))
        with caplog.at_level("WARNING", logger="hacpo.engine.checkpoint"):
            ckpt.save_atomic({"step": 2}, path)
        assert ckpt.load(path)["step"] == 2
        left = sorted(os.listdir(tmp_path))
        assert sorted([live.name, other_file.name, fresh.name, "checkpoint.pt"]) == left
        assert "died mid-save" in caplog.text and dead[0] in caplog.text
        assert other_host.name in caplog.text


def test_write_text_atomic(tmp_path):
    path = tmp_path / "sub" / "eval.json"
    ckpt.write_text_atomic(str(path), '{"a": "é"}')
    ckpt.write_text_atomic(str(path), '{"a": 2}')
    assert path.read_text() == '{"a": 2}' and os.listdir(path.parent) == ["eval.json"]


_CTRL_C_MID_SAVE = r'''
import os, signal, sys, time
import torch
from hacpo.engine import checkpoint as ckpt

class CtrlCWhilePickled:          # pickled inside torch.save's zip writer
    def __reduce__(self):
        os.kill(os.getpid(), getattr(signal, sys.argv[2]))
        time.sleep(0.2)             # the Python handler runs here, inside torch.save
        return (int, (7,))

def on_term(signum, frame):       # as `hacpo`'s CLI: SIGTERM unwinds the run
    raise SystemExit(143)
signal.signal(signal.SIGTERM, on_term)
try:
    ckpt.save_atomic({"w": torch.arange(50000.0), "x": CtrlCWhilePickled()}, sys.argv[1])
    print("saved, not interrupted")
except BaseException as e:
    print(type(e).__name__, getattr(e, "code", ""))
'''


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_during_a_save_ends_it_whole_then_interrupts(tmp_path, sig):
    """Ctrl-C (or SIGTERM) while a checkpoint is written is handled once it is whole: the
    interrupt then goes on as itself (cut inside torch.save, torch's zip writer raised
    "RuntimeError: unexpected pos" in its place: the run ended with a traceback, not the
    --resume line) and the checkpoint is there, no temp file beside it."""
    import signal
    import subprocess
    import sys
    path = tmp_path / "checkpoint.pt"
    done = subprocess.run([sys.executable, "-c", _CTRL_C_MID_SAVE, str(path), sig],
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.stdout == ("KeyboardInterrupt \n" if sig == "SIGINT" else "SystemExit 143\n"), \
        done.stdout + done.stderr
    state = torch.load(path, weights_only=False)     # the int(7) global: not a safe load
    assert state["x"] == 7 and torch.equal(state["w"], torch.arange(50000.0))
    assert os.listdir(tmp_path) == ["checkpoint.pt"]
