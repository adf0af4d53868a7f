"""Holding Ctrl-C / SIGTERM back while a step that must not stop halfway runs.

Python raises ``KeyboardInterrupt`` (or the CLI's SIGTERM exit) between any two bytecodes of
the main thread. A few steps leave something broken when cut there: spawning a worker process
(the child then reads half its start-up message), ``ray.init`` (a half-made core worker that
``ray.shutdown`` does not stop), an atomic file write (torch.save cut short raises its own
error in place of the interrupt). They run inside :func:`signals_deferred` (nested uses
compose: the outermost handles the signal when it ends).
"""
from __future__ import annotations

import contextlib
import signal
import threading

from hacpo._stop import (CHECKPOINT_SIGNAL, CHECKPOINT_STOPPED,  # noqa: F401 (re-exported)
                         clear_stop_request, raise_lost_interrupt, request_stop,
                         stop_requested)


@contextlib.contextmanager
def signals_deferred(*signums: int):
    """Run the body with the Python handlers of ``signums`` held back: a signal arriving
    meanwhile is handled once the body is done or has failed (its handler then runs, raising
    past the body), not in its middle. Signals whose handler is not a Python function
    (``SIG_IGN``, ``SIG_DFL``) are left alone. Main thread only (where Python runs signal
    handlers); elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list = []
    handlers = {}
    for sig in signums:
        handler = signal.getsignal(sig)
        if callable(handler):
            handlers[sig] = handler
            signal.signal(sig, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if caught:
            signum, frame = caught[0]
            handlers[signum](signum, frame)   # e.g. KeyboardInterrupt, past the body


# --------------------------------------------------------------------------------------------
# Stopping at a checkpoint on request (SIGUSR1 in `hacpo train`: Slurm's `--signal` before a
# job's time limit): the run writes a checkpoint at the end of its current step and stops.
# The requests themselves live in hacpo._stop (no torch: the CLI records the signal at once).
# --------------------------------------------------------------------------------------------


class RunStopped(Exception):
    """A run stopped on request (:func:`request_stop`): ``train()`` once its checkpoint of
    step ``step`` was written in ``out_dir`` (``resume=True`` continues it from there);
    compare / profile between two runs (``step`` None: nothing new to checkpoint)."""

    def __init__(self, step: int | None, out_dir: str):
        where = (f"at the checkpoint of step {step} in {out_dir}" if step is not None
                 else f"between the runs in {out_dir}")
        super().__init__(f"stopped on request {where}")
        self.step = step
        self.out_dir = out_dir


def stop_between_runs(out_dir: str) -> None:
    """compare / profile, before each run: a request that came after the run before took its
    last checkpoint (during its evaluation after RL) stops here, not in the next run; so
    does a Ctrl-C / SIGTERM that Python dropped (hacpo._stop)."""
    raise_lost_interrupt()
    if stop_requested():
        clear_stop_request()
        raise RunStopped(None, out_dir)
