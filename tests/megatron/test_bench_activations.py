"""benchmarks/bench_megatron_activations.py at a tiny size at TP=2 (its numbers are the
benchmark's business; here: every mode runs on every rank, built as asked (checked by the
benchmark itself), sequence parallel modes pad their micro-batches to even widths, and every
mode gives the baseline's log-probs and weights)."""
import json

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

from ._bench import run_benchmark  # noqa: E402

MODES = ["off", "sp", "full"]     # (selective and sp+full: the same code, in tests/megatron)


@pytest.mark.multiprocess
def test_bench_activations_tiny(tmp_path):
    proc = run_benchmark("bench_megatron_activations.py", tmp_path, "--hidden", "64",
                         "--ffn", "96", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                         "--vocab", "97", "--prompts", "3", "--group", "2", "--prompt-min", "3",
                         "--prompt-max", "6", "--response-mean", "4", "--response-max", "12",
                         "--micro-batch", "2", "--reps", "1", "--modes", "sp,full")
    out = json.loads((tmp_path / "activations.json").read_text())
    rows = {(r["mode"], r["call"]): r for r in out["rows"]}
    assert list(rows) == [(m, c) for m in MODES for c in ("score", "step")]
    assert all(len(r["peak_mib_by_rank"]) == 2 for r in out["rows"])
    off_w = rows["off", "step"]["widths"]
    assert len(off_w) == 3 and any(t % 2 for t in off_w), off_w   # 6 rows, 2 per micro-batch
    for m in MODES:
        w = rows[m, "step"]["widths"]
        if out["modes"][m]["sequence_parallel"]:
            assert all(x % 2 == 0 and t <= x <= t + 1 for t, x in zip(off_w, w)), (m, w)
        else:
            assert w == off_w, (m, w)
    assert out["same_results"] and set(out["vs_off"]) == set(MODES[1:])
    assert all(v["max_abs_logprob_diff"] < 1e-4 for v in out["vs_off"].values())
    assert "full / off, step" in proc.stdout
