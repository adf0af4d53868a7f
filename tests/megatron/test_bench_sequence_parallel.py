"""benchmarks/bench_megatron_sequence_parallel.py at a tiny size at TP=2 (its numbers are the
benchmark's business; here: both modes run on every rank, the sp mode really ran sequence
parallel with its micro-batches padded to even widths, and both give the same log-probs and
weights)."""
import json

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

from ._bench import run_benchmark  # noqa: E402


@pytest.mark.multiprocess
def test_bench_sequence_parallel_tiny(tmp_path):
    proc = run_benchmark("bench_megatron_sequence_parallel.py", tmp_path, "--hidden", "64",
                         "--ffn", "96", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                         "--vocab", "97", "--prompts", "3", "--group", "2", "--prompt-min", "3",
                         "--prompt-max", "6", "--response-mean", "4", "--response-max", "12",
                         "--micro-batch", "2", "--reps", "1")
    out = json.loads((tmp_path / "sequence_parallel.json").read_text())
    rows = {(r["mode"], r["call"]): r for r in out["rows"]}
    assert list(rows) == [("tp", "score"), ("tp", "step"), ("sp", "score"), ("sp", "step")]
    assert all(len(r["peak_mib_by_rank"]) == 2 for r in out["rows"])
    tp_w, sp_w = rows["tp", "step"]["widths"], rows["sp", "step"]["widths"]
    assert len(tp_w) == len(sp_w) == 3                        # 6 rows, 2 per micro-batch
    assert all(w % 2 == 0 and t <= w <= t + 1 for t, w in zip(tp_w, sp_w)), (tp_w, sp_w)
    assert any(t % 2 for t in tp_w), f"no odd micro-batch width to pad: {tp_w}"
    assert out["same_results"] and out["max_abs_logprob_diff"] < 1e-4
    assert "sp / tp, step" in proc.stdout
