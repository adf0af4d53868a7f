"""benchmarks/bench_megatron_lm_head.py at a tiny size at TP=2 (its numbers are the
benchmark's business; here: it runs both modes on every rank, scores exactly the response
tokens, and both modes give the same log-probs and weights)."""
import json

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

from ._bench import run_benchmark  # noqa: E402


@pytest.mark.multiprocess
def test_bench_lm_head_tiny(tmp_path):
    proc = run_benchmark("bench_megatron_lm_head.py", tmp_path, "--tp", "2", "--hidden", "64",
                         "--ffn", "96", "--heads", "4", "--kv-heads", "2", "--vocab", "97",
                         "--rows", "3", "--prompt", "5", "--response-min", "2", "--response-max",
                         "7", "--reps", "1")
    out = json.loads((tmp_path / "lm_head.json").read_text())
    # responses of 2, 4 (rounded 4.5) and 7 tokens; 3 rows x (5 + 7) positions
    assert out["scored_tokens"] == 2 + 4 + 7 and out["positions"] == 3 * 12
    assert [(r["mode"], r["call"]) for r in out["rows"]] == [
        ("logits", "score"), ("logits", "step"), ("fused", "score"), ("fused", "step")]
    assert all(len(r["peak_mib_by_rank"]) == 2 for r in out["rows"])
    # V=97 is odd: padded to 98 at TP=2, so the fused path's padding mask is in the comparison
    assert out["same_results"] and out["max_abs_logprob_diff"] < 1e-4
    assert "fused / logits, step" in proc.stdout
