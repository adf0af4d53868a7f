"""benchmarks/bench_megatron_optimizer.py at a tiny size at DP=2 (its numbers are the
benchmark's business; here: both modes run on both ranks, built as asked (checked by the
benchmark itself), each distributed rank holds about half the plain rank's Adam state and
both ranks' halves add up to it, and both modes give the same log-probs and weights)."""
import json

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

from ._bench import run_benchmark  # noqa: E402


@pytest.mark.multiprocess
def test_bench_optimizer_tiny(tmp_path):
    proc = run_benchmark("bench_megatron_optimizer.py", tmp_path, "--hidden", "64",
                         "--ffn", "96", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                         "--vocab", "97", "--prompts", "3", "--group", "2", "--prompt-min", "3",
                         "--prompt-max", "6", "--response-mean", "4", "--response-max", "12",
                         "--micro-batch", "2", "--reps", "1")
    out = json.loads((tmp_path / "optimizer.json").read_text())
    rows = {(r["mode"], r["call"]): r for r in out["rows"]}
    assert list(rows) == [(m, c) for m in ("plain", "distributed") for c in ("score", "step")]
    plain = out["memory_by_rank"]["plain"]["adam_state_mib"]
    dist = out["memory_by_rank"]["distributed"]["adam_state_mib"]
    # Adam's two fp32 moments per parameter, whole on every plain rank
    assert plain == [pytest.approx(2 * 4 * out["parameters"] / 2**20)] * 2, plain
    assert sum(dist) == pytest.approx(plain[0]) and max(dist) <= 0.6 * plain[0], dist
    assert out["same_results"] and out["max_abs_logprob_diff"] < 1e-4
    assert "distributed / plain: Adam state 0.5" in proc.stdout
