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


# --------------------------------------------------------------------------------------------
# Ctrl-C and SIGTERM as the CLI raises them (KeyboardInterrupt, SystemExit(TERMINATED)). Python
# runs a signal's handler between any two bytecodes of the main thread, a finalizer's or a
# garbage-collector callback's too, where the exception is printed ("Exception ignored in:
# <WeakKeyDictionary ...>") and dropped: the command went on as if no signal had come, to
# exit 0. While a command runs (``interrupts_recorded(True)``), each one raised is recorded
# until the command sees it unwind; one still recorded at a step's end (or when the command
# returns) was lost, and is raised again there. Outside a command (the library called from
# Python, where these handlers are not Python's own) nothing is raised again.
# --------------------------------------------------------------------------------------------

TERMINATED = 143                  # exit status of a command stopped by SIGTERM (128 + 15)

_raised: list[int] = []           # the signals whose exceptions were raised, not yet unwound
_recording: list[bool] = []       # non-empty while a command runs


def raise_interrupt(signum, frame):
    """SIGINT's handler in the CLI: KeyboardInterrupt, recorded (see above)."""
    _raised.append(signal.SIGINT)
    raise KeyboardInterrupt


def raise_terminated(signum, frame):
    """SIGTERM's handler in the CLI: SystemExit(TERMINATED), recorded (see above)."""
    _raised.append(signal.SIGTERM)
    raise SystemExit(TERMINATED)


def interrupts_recorded(on: bool) -> None:
    """A command starts (``on``) or has ended: none raised before counts as lost."""
    _raised.clear()
    _recording[:] = [True] if on else []


def lost_interrupt() -> BaseException | None:
    """The exception of a Ctrl-C / SIGTERM raised where Python dropped it while a command runs
    (cleared: raise it), or None. Called where nothing of it can be unwinding: at a step's
    end, between runs."""
    if not (_raised and _recording):
        return None
    sig = _raised[0]
    _raised.clear()
    return SystemExit(TERMINATED) if sig == signal.SIGTERM else KeyboardInterrupt()


def raise_lost_interrupt() -> None:
    if (e := lost_interrupt()) is not None:
        raise e
