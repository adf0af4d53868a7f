"""Atomic checkpoints: write to a temporary file in the same directory, fsync, rename. A crash
(even kill -9) leaves either the previous checkpoint or the new one, never half of one."""
from __future__ import annotations

import os
import tempfile

import torch


def save_atomic(obj, path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + ".", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str):
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated or foreign file
        raise RuntimeError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e})") from e
