"""benchmarks/bench_weight_pull.py at a tiny size (its numbers are the benchmark's business;
here: it runs, every mode pulls the same weights, and the buckets are the planned ones)."""
import json

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

from ._bench import run_benchmark  # noqa: E402


@pytest.mark.multiprocess
def test_bench_weight_pull_tiny(tmp_path):
    proc = run_benchmark("bench_weight_pull.py", tmp_path, "--hidden", "64", "--ffn", "96",
                         "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "96",
                         "--buckets", "1", "0.001")
    rows = json.loads((tmp_path / "weight_pull.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["whole", "1 MiB buckets", "0.001 MiB buckets"]
    # 2 layers: embedding, layer 0, layer 1, final norm + output layer; 1 MiB holds them all
    assert [r["buckets"] for r in rows] == [1, 1, 4]
    # untied Llama: embed + lm_head + final norm + 9 tensors per layer
    assert {r["tensors"] for r in rows} == {3 + 2 * 9}
    assert all(r["same_weights_as_whole"] for r in rows)
    assert len({r["pulled_mib"] for r in rows}) == 1
    assert all(len(r["peak_mib_by_rank"]) == 2 for r in rows) and "rank 0's peak" in proc.stdout
