"""Token-budget micro-batching: which rows go to which DP rank, and into which micro-batch.

RL responses vary widely in length (a short answer next to a long chain of thought). Cutting a
minibatch into micro-batches of a fixed row count pads every row to the longest one beside it
and lets a micro-batch of long rows take as much activation memory as the row count times the
longest length. With a token budget the micro-batches are packed instead: rows sorted by
length, longest first, a micro-batch holding rows while ``rows x longest <= max_tokens`` (the
padded tensor a forward runs on), so activation memory is bounded by the budget and padding is
small; a row longer than the budget is a micro-batch of its own.

Shares of a minibatch across DP ranks are balanced by tokens, not by row counts: rows dealt
longest first, each to the share with the fewest tokens so far (the greedy longest-processing-
time rule), so no DP rank waits long for another at the gradient all-reduce.

Lengths are plain ints (tokens a row's forward runs over); nothing here touches tensors,
models or process groups. Every planner returns each row exactly once; the order of rows in
the result decides only the order of float sums (the loss divides by the minibatch's global
divisor, so the value does not depend on the plan).
"""
from __future__ import annotations

from collections.abc import Sequence


def _check(lengths: Sequence[int], rows: Sequence[int] | None) -> list[int]:
    rows = list(range(len(lengths))) if rows is None else list(rows)
    if len(set(rows)) != len(rows):
        raise ValueError("rows must not repeat")
    for j in rows:
        if not 0 <= j < len(lengths):
            raise ValueError(f"row {j} is out of range for {len(lengths)} lengths")
        if lengths[j] < 1:
            raise ValueError(f"row {j} has length {lengths[j]}; every row needs >= 1 token")
    return rows


def longest_first(lengths: Sequence[int], rows: Sequence[int]) -> list[int]:
    """``rows`` by length, longest first; equal lengths keep their order in ``rows``."""
    return sorted(rows, key=lambda j: -lengths[j])


def balanced_shares(lengths: Sequence[int], parts: int,
                    rows: Sequence[int] | None = None) -> list[list[int]]:
    """Deal ``rows`` (default: all) into ``parts`` shares of nearly equal token sums.

    Longest row first, each to the share with the fewest tokens so far (ties: fewer rows,
    then the lower share). Every share lists its rows in ascending order. The largest share
    exceeds the mean by at most the longest row."""
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
        raise ValueError(f"parts must be an integer >= 1, got {parts!r}")
    rows = _check(lengths, rows)
    shares: list[list[int]] = [[] for _ in range(parts)]
    tokens = [0] * parts
    for j in longest_first(lengths, rows):
        d = min(range(parts), key=lambda i: (tokens[i], len(shares[i]), i))
        shares[d].append(j)
        tokens[d] += lengths[j]
    return [sorted(s) for s in shares]


def pack_micro_batches(lengths: Sequence[int], max_tokens: int, max_rows: int,
                       rows: Sequence[int] | None = None) -> list[list[int]]:
    """Pack ``rows`` (default: all) into micro-batches of at most ``max_rows`` rows whose
    padded size, rows x their longest length, is at most ``max_tokens``.

    Rows go longest first; a micro-batch takes the next row while both limits hold, so each
    micro-batch's first row is its longest. A row longer than ``max_tokens`` is a micro-batch
    of its own (it cannot be split: its tokens attend to each other)."""
    for name, v in (("max_tokens", max_tokens), ("max_rows", max_rows)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    out: list[list[int]] = []
    for j in longest_first(lengths, _check(lengths, rows)):
        cur = out[-1] if out else None
        if cur and len(cur) < max_rows and (len(cur) + 1) * lengths[cur[0]] <= max_tokens:
            cur.append(j)
        else:
            out.append([j])
    return out


def padded_tokens(lengths: Sequence[int], micro_batches: Sequence[Sequence[int]]) -> int:
    """Tokens the micro-batches' padded tensors hold: sum of rows x longest length."""
    return sum(len(mb) * max(lengths[j] for j in mb) for mb in micro_batches if mb)
