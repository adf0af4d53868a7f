"""Atomic checkpoints: write to a temporary file in the same directory, fsync, rename. A crash
(even kill -9) leaves either the previous checkpoint or the new one, never half of one."""
from __future__ import annotations

import os
import pickle
import re
import tempfile
import zipfile

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


# A checkpoint is a pickle: loading one with arbitrary Python objects can run arbitrary code.
# hacpo's own checkpoints hold tensors, numbers, strings, lists and dicts only, so they load with
# torch.load(weights_only=True), which refuses anything else; this variable (=1) allows a full
# unpickle for a file one trusts (e.g. a checkpoint written before that rule).
TRUST_ENV = "HACPO_TRUSTED_CHECKPOINTS"


def load(path: str):
    """The object saved at ``path``, unpickled with ``weights_only=True`` (tensors and plain
    containers only; see :data:`TRUST_ENV`). A file that cannot be read, or holds other
    objects, is a RuntimeError naming it."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    trusted = os.environ.get(TRUST_ENV) == "1"
    try:
        return torch.load(path, map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as e:
        # torch.save writes a zip archive: one whose pickle the weights-only unpickler refused
        # holds other objects; anything else is not a (whole) checkpoint
        if trusted or not zipfile.is_zipfile(path):
            raise RuntimeError(f"checkpoint {path} cannot be read (UnpicklingError: "
                               f"{str(e).splitlines()[0]})") from e
        detail = next((ln.strip() for ln in str(e).splitlines()
                       if re.search(r"GLOBAL|Unsupported|Can only build|got <", ln)), "")
        raise RuntimeError(
            f"checkpoint {path} holds Python objects other than tensors and plain containers "
            f"(a foreign file, or one written by an older hacpo), which could run code when "
            f"loaded; not loaded. If you trust it, set {TRUST_ENV}=1"
            + (f" (torch: {detail[:300]})" if detail else "")) from None
    except Exception as e:  # truncated or foreign file
        raise RuntimeError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e})") from e
