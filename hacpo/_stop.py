"""Requests to stop a run at a checkpoint: `hacpo train` turns SIGUSR1 (Slurm's ``--signal``
before a time limit) into one, which the trainer takes up at the end of the step it is in
(``hacpo.engine.signals``). Kept apart from ``hacpo.engine`` (which imports torch) so that the
command records the signal from its first moment: SIGUSR1's default action kills the process,
which the job script would read as a failure (or, before this, as the checkpoint's exit)."""
from __future__ import annotations

import signal
import threading

CHECKPOINT_SIGNAL = signal.SIGUSR1
# the exit status of a command stopped at its checkpoint: EX_TEMPFAIL ("try again": --resume),
# not 128 + SIGUSR1, which is what a shell reports for a process the signal killed
CHECKPOINT_STOPPED = 75

# the requests not yet taken up; a list (appending is atomic: no lock that a signal handler
# could find held by the code it interrupts)
_requests: list[bool] = []


def request_stop() -> None:
    """Ask the run in progress (or the next one this process starts) to write a checkpoint at
    the end of its current step and stop there. Safe from any thread and a signal handler."""
    _requests.append(True)


def stop_requested() -> bool:
    return bool(_requests)


def clear_stop_request() -> None:
    _requests.clear()


def record_checkpoint_signal() -> None:
    """From now on, for the rest of the process, CHECKPOINT_SIGNAL is a stop request (its
    default action killed the process); a request left from before is dropped. Main thread
    only (where Python runs signal handlers); elsewhere a no-op."""
    if threading.current_thread() is threading.main_thread():
        clear_stop_request()
        signal.signal(CHECKPOINT_SIGNAL, lambda signum, frame: request_stop())
