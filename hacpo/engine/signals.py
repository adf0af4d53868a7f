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
