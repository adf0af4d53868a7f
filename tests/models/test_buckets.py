"""hacpo.models.buckets: bucket plans, bucketed state dicts, and in-place copies that take every
weight exactly once."""
import pytest
import torch

from hacpo.models.buckets import (bucket_bytes_of, check_bucket_shapes, copy_buckets,
                                  plan_buckets, weight_buckets)


def _weights():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(4, 4, generator=g),            # 64 B
            "b": torch.randn(2, generator=g),               # 8 B
            "c": torch.randn(30, generator=g),              # 120 B (bigger than a bucket)
            "d": torch.randn(3, generator=g).double()}      # 24 B


def test_weight_buckets_in_order_and_by_bytes():
    w = _weights()
    buckets = weight_buckets(w, 100)
    assert [list(b) for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert all(b[n] is w[n] for b in buckets for n in b)       # views, not copies
    assert [list(b) for b in weight_buckets(w, 10 ** 6)] == [["a", "b", "c", "d"]]
    assert [list(b) for b in weight_buckets(w, 1)] == [["a"], ["b"], ["c"], ["d"]]
    assert plan_buckets([("x", 5), ("y", 5)], 10) == [["x", "y"]]
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        weight_buckets(w, 0)
    assert bucket_bytes_of(0.5) == 2 ** 19 and bucket_bytes_of(1e-9) == 1


def test_copy_buckets_in_place():
    src = _weights()
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    ptrs = {n: t.data_ptr() for n, t in dst.items()}
    assert copy_buckets(dst, iter(weight_buckets(src, 100)), what="x") == 3
    assert all(torch.equal(dst[n], src[n]) and dst[n].data_ptr() == ptrs[n] for n in src)


@pytest.mark.parametrize("bucket, match", [
    ({"e": torch.zeros(1)}, r"weight 'e' \(1,\) does not fit: there is no such weight"),
    ({"a": torch.zeros(4, 4)}, r"weight 'a' \(4, 4\) does not fit: sent twice"),
    ({"b": torch.zeros(3)}, r"weight 'b' \(3,\) does not fit: the target's is \(2,\)"),
])
def test_copy_buckets_errors(bucket, match):
    src = _weights()
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    with pytest.raises(RuntimeError, match=r"^agent 'x': " + match):
        copy_buckets(dst, [{"a": src["a"]}, bucket], what="agent 'x'")
    with pytest.raises(RuntimeError, match=r"^agent 'x': weights missing: \['c', 'd'\]"):
        copy_buckets(dst, [{"a": src["a"], "b": src["b"]}], what="agent 'x'")


@pytest.mark.parametrize("bucket, match", [
    ({"e": torch.zeros(1)}, r"weight 'e' \(1,\) does not fit: there is no such weight"),
    ({"a": torch.zeros(4, 4)}, r"weight 'a' \(4, 4\) does not fit: sent twice"),
    ({"b": torch.zeros(3)}, r"weight 'b' \(3,\) does not fit: the target's is \(2,\)"),
])
def test_check_bucket_shapes_as_copy_buckets_on_shapes_alone(bucket, match):
    """Buckets that go elsewhere (megatron -> vLLM) are checked on their names and shapes
    with copy_buckets' rules and messages; the target is left untouched."""
    src = _weights()
    dst = {n: torch.zeros_like(t) for n, t in src.items()}

    def shapes(b):
        return {n: tuple(t.shape) for n, t in b.items()}
    check_bucket_shapes(dst, [shapes(b) for b in weight_buckets(src, 100)], what="x")
    with pytest.raises(RuntimeError, match=r"^agent 'x': " + match):
        check_bucket_shapes(dst, [shapes({"a": src["a"]}), shapes(bucket)], what="agent 'x'")
    with pytest.raises(RuntimeError, match=r"^agent 'x': weights missing: \['c', 'd'\]"):
        check_bucket_shapes(dst, [shapes({"a": src["a"], "b": src["b"]})], what="agent 'x'")
    assert all(not t.any() for t in dst.values())
