"""benchmarks/bench_megatron_micro_batches.py at a tiny size at TP=2 (its numbers are the
benchmark's business; here: both modes run on every rank, the token budget gives fewer
micro-batches within the same worst case, and both give the same log-probs and weights)."""
import json

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

from ._bench import run_benchmark  # noqa: E402


@pytest.mark.multiprocess
def test_bench_micro_batches_tiny(tmp_path):
    proc = run_benchmark("bench_megatron_micro_batches.py", tmp_path, "--tp", "2", "--hidden",
                         "64", "--ffn", "96", "--heads", "4", "--kv-heads", "2", "--vocab", "97",
                         "--prompts", "3", "--group", "3", "--prompt-min", "3", "--prompt-max",
                         "6", "--response-mean", "4", "--response-max", "12", "--micro-batch", "2",
                         "--reps", "1")
    out = json.loads((tmp_path / "micro_batches.json").read_text())
    rows = {(r["mode"], r["call"]): r for r in out["rows"]}
    assert list(rows) == [("rows", "score"), ("rows", "step"), ("tokens", "score"),
                          ("tokens", "step")]
    assert all(len(r["peak_mib_by_rank"]) == 2 for r in out["rows"])
    # the default budget: 2 rows x the longest row; no micro-batch over it, fewer of them
    budget = out["layout"]["micro_batch_tokens"]
    assert budget == 2 * out["longest_row"]
    for call in ("score", "step"):
        tok, fixed = rows["tokens", call], rows["rows", call]
        assert tok["largest_micro_batch_tokens"] <= budget
        assert tok["micro_batches"] < fixed["micro_batches"] == 5       # 9 rows, 2 per batch
        assert out["row_tokens"] - 9 <= tok["padded_tokens"] <= fixed["padded_tokens"]
    assert out["same_results"] and out["max_abs_logprob_diff"] < 1e-4
    assert "tokens / rows, step" in proc.stdout
