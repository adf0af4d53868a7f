"""Shared by the benchmark scripts: percentiles of repeated wall times, and the argparse checks
every script makes before it measures (positive counts, a writable place for its results)."""
from __future__ import annotations

import argparse
import math
import os

QUANTILES = (0.2, 0.5, 0.8)


def pct(xs: list[float], q: float) -> float:
    """The ``q`` percentile of ``xs`` (0 <= q <= 1) by linear interpolation between the two
    closest ranks: position ``q * (len(xs) - 1)`` in the sorted values, numpy's default
    ("linear") and, at q = 0.5, ``statistics.median``. One rule for every script, so that their
    p20/p50/p80 are comparable (they once rounded the position half to even or half up)."""
    if not xs:
        raise ValueError("no values to take a percentile of")
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])


def percentiles(by_key: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """``{"p20": {key: ...}, "p50": ..., "p80": ...}`` of every key's times."""
    return {f"p{int(q * 100)}": {k: pct(ts, q) for k, ts in by_key.items()} for q in QUANTILES}


def positive_int(text: str) -> int:
    """argparse ``type=`` of a count that must be >= 1 (reps, sizes, layouts): 0 or less is a
    usage error at parse time, not a ZeroDivisionError or an empty table after the work."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def positive_float(text: str) -> float:
    """argparse ``type=`` of a size that must be > 0 (and finite)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not 0 < v < math.inf:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def results_dir(ap: argparse.ArgumentParser, path: str) -> str:
    """Create the results directory ``path`` (and its parents) before anything is measured: a
    path that is a file, or that cannot be created or written, is a usage error naming it, not
    a traceback after minutes of work."""
    if os.path.exists(path) and not os.path.isdir(path):
        ap.error(f"results directory {path} is a file")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        ap.error(f"cannot create results directory {path}: {e.strerror or e}")
    if not os.access(path, os.W_OK | os.X_OK):
        ap.error(f"results directory {path} is not writable")
    return path


def results_file(ap: argparse.ArgumentParser, path: str) -> str:
    """Check (creating its directory, as ``results_dir``) that the results file ``path`` can be
    written, before anything is measured: the same usage errors, naming the path."""
    if os.path.isdir(path):
        ap.error(f"results file {path} is a directory")
    results_dir(ap, os.path.dirname(os.path.abspath(path)))
    if os.path.exists(path) and not os.access(path, os.W_OK):
        ap.error(f"results file {path} is not writable")
    return path
