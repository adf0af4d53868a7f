"""Crash consistency of ``hacpo train --resume`` with a megatron-core trainer group (TP=1, one
rank actor on gloo, sharded optimizer checkpoints, the KL term's reference shards) against a
real local Ray cluster. The crash is simulated at an exact point: an exception no code catches
(``Crash``, a BaseException) raised where a kill -9 would stop the driver, so the run dir holds
what it holds after that kill. (Timed SIGKILLs of the driver's process group at 23 moments,
with the Ray backend and with megatron groups, each resumed to a checkpoint bit-for-bit the
uninterrupted run's, were run by hand; a timed kill cannot land in the window checked here.)
"""
import glob
import os

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

from hacpo.engine import checkpoint as ckpt  # noqa: E402
from hacpo.engine.run_config import ParallelConfig  # noqa: E402
from hacpo.engine.trainer import train  # noqa: E402
from hacpo.launch import megatron_trainer  # noqa: E402

from ._launch_helpers import free_cpus_back  # noqa: E402
from .test_megatron_trainer import megatron_cfg  # noqa: E402  (its reward, the CPU hook)

AGENTS = (("llama-tp1", "llama3.2", ParallelConfig()), ("char", "char", None))
KL = {"algorithm.loss.kl_coef": 0.01}


class Crash(BaseException):
    """The driver dying here (nothing catches a BaseException that is not an Exception's)."""


def _shard_dirs(out):
    return sorted(os.path.relpath(p, out)
                  for p in glob.glob(os.path.join(out, "checkpoint-megatron", "*", "*")))


def _named_dirs(out):
    meg = ckpt.load(os.path.join(out, "checkpoint.pt"))["agents"][0]["megatron"]
    files = meg["optim_files"] + [f["path"] for f in meg["ref_files"]]
    return sorted({os.path.dirname(f) for f in files})


def test_crash_after_final_checkpoint_rename_leaves_no_stale_shards(cluster, tmp_path,
                                                                     monkeypatch):
    """The run dies after its last checkpoint (step 2) is renamed into place and before
    ``checkpoint_saved`` deletes the step-1 save's shard directory. ``--resume`` (nothing left
    to train, so no save) deletes the directory the checkpoint does not name, keeps the
    optimizer and KL reference shards it names, and a later resume with more steps reads
    them."""
    out = str(tmp_path / "run")
    quiet = dict(echo=lambda *_: None)
    real = megatron_trainer.MegatronAgents.checkpoint_saved
    calls = []

    def saved(self):
        calls.append(1)
        if len(calls) == 2:                       # the step-2 checkpoint is on disk
            raise Crash
        real(self)
    with monkeypatch.context() as mp:
        mp.setattr(megatron_trainer.MegatronAgents, "checkpoint_saved", saved)
        with pytest.raises(Crash):
            train(megatron_cfg(tmp_path, "run", "megatron", agents=AGENTS, steps=2, **KL),
                  **quiet)
    free_cpus_back()
    assert ckpt.load(os.path.join(out, "checkpoint.pt"))["step"] == 2
    named = _named_dirs(out)
    assert len(named) == 2 and any("reference-" in d for d in named)   # optimizer, reference
    stale = sorted(set(_shard_dirs(out)) - set(named))
    assert len(stale) == 1, _shard_dirs(out)      # the step-1 save's optimizer shards

    train(megatron_cfg(tmp_path, "run", "megatron", agents=AGENTS, steps=2, **KL),
          resume=True, **quiet)
    free_cpus_back()
    assert _shard_dirs(out) == named              # stale one gone, the named ones kept
    assert os.path.exists(os.path.join(out, "summary.json"))

    train(megatron_cfg(tmp_path, "run", "megatron", agents=AGENTS, steps=3, **KL),
          resume=True, **quiet)                   # reads the kept optimizer + reference shards
    free_cpus_back()
    assert ckpt.load(os.path.join(out, "checkpoint.pt"))["step"] == 3
    assert _shard_dirs(out) == _named_dirs(out)
    ref = next(d for d in named if "reference-" in d)
    assert ref in _named_dirs(out)                # the reference is written once per run
