"""Shared by the agents-at-once benchmarks (bench_rollout_agents.py, bench_agents_at_once.py):
nearest-rank percentiles of repeated wall times."""
from __future__ import annotations

QUANTILES = (0.2, 0.5, 0.8)


def pct(xs: list[float], q: float) -> float:
    """The ``q`` percentile of ``xs`` (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def percentiles(by_key: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """``{"p20": {key: ...}, "p50": ..., "p80": ...}`` of every key's times."""
    return {f"p{int(q * 100)}": {k: pct(ts, q) for k, ts in by_key.items()} for q in QUANTILES}
