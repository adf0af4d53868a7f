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
# --------------------------------------------------------------------------------------------
CHECKPOINT_SIGNAL = signal.SIGUSR1
CHECKPOINT_STOPPED = 128 + CHECKPOINT_SIGNAL    # a CLI run's exit status then (138 on Linux)

# the requests not yet taken up; a list (appending is atomic; no lock a signal handler could
# find held by the thread it interrupts)
_stop_requests: list[bool] = []


class RunStopped(Exception):
    """``train()`` stopped on request (:func:`request_stop`) once its checkpoint of step
    ``step`` was written in ``out_dir``: ``resume=True`` continues it from there."""

    def __init__(self, step: int, out_dir: str):
        super().__init__(f"stopped on request at the checkpoint of step {step} in {out_dir}; "
                         f"resume=True continues it")
        self.step = step
        self.out_dir = out_dir


def request_stop() -> None:
    """Ask the run in progress (or the next one this process starts) to write a checkpoint at
    the end of its current step and stop there (:class:`RunStopped`). Safe from any thread
    and from a signal handler."""
    _stop_requests.append(True)


def stop_requested() -> bool:
    return bool(_stop_requests)


def clear_stop_request() -> None:
    _stop_requests.clear()


def _on_checkpoint_signal(signum, frame) -> None:
    request_stop()


@contextlib.contextmanager
def stop_on_checkpoint_signal():
    """The body with CHECKPOINT_SIGNAL (SIGUSR1) asking the run to stop at a checkpoint
    (its default action kills the process, losing the steps since the last checkpoint); a
    request left from before is dropped. Main thread only; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    clear_stop_request()
    previous = signal.signal(CHECKPOINT_SIGNAL, _on_checkpoint_signal)
    try:
        yield
    finally:
        signal.signal(CHECKPOINT_SIGNAL, previous)
