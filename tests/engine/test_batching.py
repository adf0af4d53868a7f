"""Token-budget micro-batching (hacpo/engine/batching.py): every row exactly once, the budget
and the row limit hold (a longer row alone), DP shares balanced by tokens, clear errors."""
import random

import pytest

from hacpo.engine.batching import (balanced_shares, longest_first, pack_micro_batches,
                                   padded_tokens)


def _skewed(n: int, seed: int) -> list[int]:
    """RL-like lengths: a prompt of 20-60 tokens plus a response of 1-400 (most short)."""
    rng = random.Random(seed)
    return [rng.randint(20, 60) + min(400, int(rng.expovariate(1 / 80)) + 1) for _ in range(n)]


def test_pack_small_example():
    lengths = [8, 6, 1, 7]
    # longest first: 0 (8), 3 (7), 1 (6), 2 (1); [0, 3] would be 2 x 8 = 16 > 14
    assert pack_micro_batches(lengths, 14, 3) == [[0], [3, 1], [2]]
    assert pack_micro_batches(lengths, 16, 3) == [[0, 3], [1, 2]]
    assert pack_micro_batches(lengths, 100, 3) == [[0, 3, 1], [2]]      # the row limit
    assert pack_micro_batches(lengths, 5, 3) == [[0], [3], [1], [2]]    # rows over the budget
    assert pack_micro_batches(lengths, 14, 3, rows=[2, 1]) == [[1, 2]]
    assert padded_tokens(lengths, [[0], [3, 1], [2]]) == 8 + 14 + 1


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("max_tokens,max_rows", [(512, 256), (1024, 4), (300, 256)])
def test_pack_holds_the_limits(seed, max_tokens, max_rows):
    lengths = _skewed(97, seed)
    rows = list(range(0, 97, 2)) if seed % 2 else None
    mbs = pack_micro_batches(lengths, max_tokens, max_rows, rows)
    flat = [j for mb in mbs for j in mb]
    assert sorted(flat) == (sorted(rows) if rows is not None else list(range(97)))
    for mb in mbs:
        assert 1 <= len(mb) <= max_rows
        assert lengths[mb[0]] == max(lengths[j] for j in mb)          # first row is the longest
        if len(mb) > 1:         # a single row may exceed the budget (it cannot be split)
            assert len(mb) * lengths[mb[0]] <= max_tokens
    # greedy: the next micro-batch's first row would not have fitted into the one before
    for a, b in zip(mbs, mbs[1:]):
        assert len(a) == max_rows or (len(a) + 1) * lengths[a[0]] > max_tokens


def test_packing_pads_less_than_fixed_row_chunks():
    """The point of the budget: on skewed lengths, in the order rows arrive, chunks of a fixed
    row count pad far more than budget packing with the same number of micro-batches or
    fewer."""
    lengths = _skewed(256, 0)
    mbs = pack_micro_batches(lengths, 2048, 256)
    rows = -(-256 // len(mbs))                      # fixed chunks giving as many micro-batches
    fixed = [list(range(i, min(i + rows, 256))) for i in range(0, 256, rows)]
    assert len(fixed) <= len(mbs)
    real = sum(lengths)
    assert padded_tokens(lengths, mbs) < 1.15 * real
    assert padded_tokens(lengths, fixed) > 2 * real
    assert padded_tokens(lengths, fixed) > 1.7 * padded_tokens(lengths, mbs)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_balanced_shares(seed, parts):
    lengths = _skewed(61, seed)
    shares = balanced_shares(lengths, parts)
    assert len(shares) == parts
    assert sorted(j for s in shares for j in s) == list(range(61))
    assert all(s == sorted(s) for s in shares)
    tokens = [sum(lengths[j] for j in s) for s in shares]
    assert max(tokens) - sum(lengths) / parts <= max(lengths)
    if parts > 1:       # contiguous equal-row shares are much less even on these lengths
        contiguous = [sum(lengths[d * 61 // parts:(d + 1) * 61 // parts]) for d in range(parts)]
        assert max(tokens) - min(tokens) <= max(contiguous) - min(contiguous)


def test_balanced_shares_small_example():
    # longest first: 10 -> share 0, 9 -> 1, 5 -> 1 (9 < 10), 4 -> 0 (10 < 14), 1 -> 0 (14 = 14,
    # equal rows too: the lower share)
    assert balanced_shares([5, 10, 1, 4, 9], 2) == [[1, 2, 3], [0, 4]]
    assert balanced_shares([3, 3], 4) == [[0], [1], [], []]
    assert balanced_shares([3, 3, 2], 2, rows=[2, 0]) == [[0], [2]]
    assert longest_first([2, 5, 5, 1], [3, 2, 0, 1]) == [2, 1, 0, 3]   # ties keep their order


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
        pack_micro_batches([3], 0, 4)
    with pytest.raises(ValueError, match="max_rows must be an integer >= 1, got 0"):
        pack_micro_batches([3], 8, 0)
    with pytest.raises(ValueError, match="parts must be an integer >= 1, got 0"):
        balanced_shares([3], 0)
    with pytest.raises(ValueError, match="rows must not repeat"):
        pack_micro_batches([3, 4], 8, 4, rows=[1, 1])
    with pytest.raises(ValueError, match="row 2 is out of range for 2 lengths"):
        balanced_shares([3, 4], 2, rows=[2])
    with pytest.raises(ValueError, match="row 1 has length 0; every row needs >= 1 token"):
        pack_micro_batches([3, 0], 8, 4)
