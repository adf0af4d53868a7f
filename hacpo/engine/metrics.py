"""Run-directory logging: metrics JSONL (one line per step) and TensorBoard events."""
from __future__ import annotations

import json
import math
import os


class MetricsLogger:
    """Appends one JSON line per step. On resume from step s, lines of steps >= s (written
    after the checkpoint, by the interrupted run) are dropped first, so the file ends up the
    same as an uninterrupted run's."""

    def __init__(self, out_dir: str, *, start_step: int = 0, tensorboard: bool = True):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        if start_step > 0 and os.path.exists(self.path):
            with open(self.path) as f:
                keep = [ln for ln in f if ln.strip() and json.loads(ln)["step"] < start_step]
            with open(self.path, "w") as f:
                f.writelines(keep)
        else:              # a new run (or nothing logged before): an empty file, also for 0 steps
            open(self.path, "w").close()
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"),
                                    purge_step=start_step if start_step > 0 else None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and v is not None and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]
