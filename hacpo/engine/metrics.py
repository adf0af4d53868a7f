"""Run-directory logging: metrics JSONL (one line per step) and TensorBoard events."""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os

from .checkpoint import _write_atomic, remove_stale_temps
from .errors import StorageError, describe_os_error

log = logging.getLogger(__name__)


class MetricsLogger:
    """Appends one JSON line per step. On resume from step s, lines of steps >= s (written
    after the checkpoint, by the interrupted run) are dropped first, so the file ends up the
    same as an uninterrupted run's."""

    def __init__(self, out_dir: str, *, start_step: int = 0, tensorboard: bool = True):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.dropped: list[int] = []    # a resume: the steps of rows past its checkpoint
        if start_step > 0:
            keep, self.dropped = _rows_before(self.path, start_step) \
                if os.path.exists(self.path) else ([], [])
            _warn_missing_rows(self.path, keep, start_step)
            # a new file renamed over the old one: a crash (or a full disk) while it is written
            # leaves the old file, never a truncated one (the steps before start_step are gone)
            # (as the checkpoints: a locked temp file named after its writer, so a temp file
            # left by a writer killed mid-rewrite is removed by the next rewrite)
            data = "".join(keep).encode()
            _write_atomic(self.path, lambda f: f.write(data))
        else:              # a new run (or nothing logged before): an empty file, also for 0 steps
            open(self.path, "w").close()
        removed = remove_stale_temps(self.path)
        if removed:
            log.warning("removed %d temporary file(s) left by a writer of %s that died "
                        "mid-save: %s", len(removed), self.path, ", ".join(removed))
        self.tb = None
        if tensorboard:     # (train() checked the package first: without it, it passes False)
            from torch.utils.tensorboard import SummaryWriter
            # purge also at step 0: a run restarted without a checkpoint (killed before its
            # first) hides the killed run's events, as a resume hides those after its step
            try:
                self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"),
                                        purge_step=start_step)
            except _TB_ERRORS as e:
                self._tensorboard_failed(e)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in metrics.items()}}
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:     # a full disk's error names no file: say which, and what is kept
            out_dir = os.path.dirname(self.path) or "."
            if not os.path.isdir(out_dir):      # nothing is kept there to resume from
                raise StorageError.like(e, f"cannot write {self.path}: the run dir {out_dir} "
                                           f"no longer exists (removed or moved while the run "
                                           f"went on)", self.path) from None
            raise StorageError.like(e, f"cannot write {self.path}: {describe_os_error(e)}; "
                                       f"the rows of the steps before are kept (a cut last row "
                                       f"is dropped on --resume, which continues from the last "
                                       f"checkpoint)", self.path) from None
        self.tensorboard_scalars(step, {k: v for k, v in metrics.items() if isinstance(
            v, (int, float)) and math.isfinite(v)})

    def tensorboard_scalars(self, step: int, metrics: dict[str, float]) -> None:
        """``metrics`` to TensorBoard (a row's, or one written before: ``amend_row``)."""
        self._tensorboard(lambda tb: [tb.add_scalar(k, v, step) for k, v in metrics.items()])

    def _tensorboard(self, write) -> None:
        """``write(SummaryWriter)``; an I/O error (a full disk: its writer thread's error comes
        back on the next call, naming no file) is a warning naming the folder, and the run goes
        on without TensorBoard: metrics.jsonl holds every row, and its own write names a full
        disk as the error it is."""
        if self.tb is None:
            return
        try:
            write(self.tb)
        except _TB_ERRORS as e:
            tb, self.tb = self.tb, None
            self._tensorboard_failed(e)
            with contextlib.suppress(Exception):
                tb.close()

    def _tensorboard_failed(self, e: Exception) -> None:
        log.warning("TensorBoard events in %s cannot be written (%s): the run goes on "
                    "without them (metrics.jsonl holds every row)",
                    os.path.join(os.path.dirname(self.path), "tensorboard"),
                    describe_os_error(e) if isinstance(e, OSError)
                    else f"its path is not valid UTF-8: {e}")

    def close(self) -> None:
        self._tensorboard(lambda tb: (tb.flush(), tb.close()))


# what makes TensorBoard's events a warning: an I/O error, or a run dir named in another
# encoding (Python's surrogate escapes: every file of the run works, TensorBoard's wants UTF-8)
_TB_ERRORS = (OSError, UnicodeEncodeError)


def _warn_missing_rows(path: str, keep: list[str], start_step: int) -> None:
    """A resume at ``start_step`` whose metrics.jsonl lacks rows of earlier steps (deleted or
    cut short while the run was stopped): those steps are not logged again, so say which."""
    have = {json.loads(ln)["step"] for ln in keep}
    missing = [s for s in range(start_step) if s not in have]
    if not missing:
        return
    spans, first = [], missing[0]
    for a, b in zip(missing, missing[1:] + [None]):
        if b != a + 1:
            spans.append(f"{first}" if first == a else f"{first}-{a}")
            first = b
    log.warning("%s holds no rows of steps %s (of the %d before this resume: deleted or cut "
                "short while the run was stopped); they are not logged again, the run goes on "
                "from step %d", path, ", ".join(spans), start_step, start_step)


def _rows_before(path: str, start_step: int) -> tuple[list[str], list[int]]:
    """The lines of ``path`` of steps < ``start_step``, and the steps of the rows dropped (those
    logged after the checkpoint). A last line cut short (no newline: the interrupted run's
    last write, e.g. on a full disk; it logged a step >= start_step, as every step is logged
    before its checkpoint) is dropped; any other unreadable line is a ValueError naming the
    file and line."""
    with open(path, "rb") as f:
        lines = f.readlines()
    keep, dropped = [], []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            ln = raw.decode("utf-8")
            step = json.loads(ln)["step"]
        except (ValueError, KeyError, TypeError) as e:   # (UnicodeDecodeError: a ValueError)
            if i == len(lines) - 1 and not raw.endswith(b"\n"):
                break
            raise ValueError(f"{path}:line {i + 1} is not a metrics row ({type(e).__name__}: "
                             f"{e}); fix or remove that line to resume") from None
        if step < start_step:
            keep.append(ln if ln.endswith("\n") else ln + "\n")   # the next row on its own line
        else:
            dropped.append(step)
    return keep, dropped


def amend_row(path: str, step: int, values: dict[str, float]) -> bool:
    """Add ``values`` to the row of ``step`` in the metrics file at ``path`` (rewritten
    atomically, as a resume's rewrite is). False, and nothing written, when that row is not
    there or holds any of the keys already."""
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        lines = f.readlines()
    for i, ln in enumerate(lines):
        try:
            row = json.loads(ln)
        except ValueError:
            continue           # an unreadable line: the resume's own check names it
        if isinstance(row, dict) and row.get("step") == step:
            if any(k in row for k in values):
                return False
            lines[i] = json.dumps({**row, **values}) + "\n"
            data = "".join(lines).encode()
            _write_atomic(path, lambda f: f.write(data))
            return True
    return False


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]
