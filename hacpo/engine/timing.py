"""Per-stage wall-time accounting for the trainer (metrics ``time/...``).

``Stopwatch(sync)`` is a dict of accumulated seconds; ``with sw("time/update/a"): ...`` adds the
block's wall time to that key. With ``sync`` (e.g. ``torch.cuda.synchronize``) the device is
synchronized at both ends of every block so asynchronous GPU work is charged to the stage that
launched it; that costs throughput, so it is on only when asked for (``profile_sync``).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator


class Stopwatch(dict):
    def __init__(self, sync: Callable[[], None] | None = None):
        super().__init__()
        self.sync = sync

    @contextmanager
    def __call__(self, key: str) -> Iterator[None]:
        if self.sync is not None:
            self.sync()
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self[key] = self.get(key, 0.0) + time.perf_counter() - t

    def scoped(self, prefix: str, suffix: str = "") -> "Callable[[str], object]":
        """A timer for one component: ``scoped("time/", "/a")("score_self")`` charges
        ``time/score_self/a``."""
        return lambda key: self(f"{prefix}{key}{suffix}")


def device_sync(enabled: bool) -> Callable[[], None] | None:
    """torch.cuda.synchronize when enabled and CUDA is in use; None otherwise."""
    import torch
    if enabled and torch.cuda.is_available():
        return torch.cuda.synchronize
    return None


@contextmanager
def _nothing(_key: str) -> Iterator[None]:
    yield


def null_timer(key: str):
    """A timer that measures nothing (for callers that do not account stages)."""
    return _nothing(key)
