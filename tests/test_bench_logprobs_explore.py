"""benchmarks/bench_logprobs.py rerun into the results directory of an earlier run: what it
leaves there is this run's results only."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import bench_logprobs  # noqa: E402


def test_a_rerun_with_no_case_run_leaves_no_plot_of_the_earlier_run(tmp_path, monkeypatch,
                                                                      capsys):
    """Every case failed (over --case-timeout, say): results.csv / .json say no row, and the
    results.png of the run before (the same --out) is gone, not shown beside them."""
    (tmp_path / "results.png").write_bytes(b"an earlier run's plot")
    monkeypatch.setattr(bench_logprobs, "run_case", lambda *_a, **_k: (None, "over 1s"))
    rc = bench_logprobs.main(["--device", "cpu", "--ops", "logits", "--reps", "1",
                              "--out", str(tmp_path)])
    assert rc == 1 and "no case ran" in capsys.readouterr().out
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored["rows"] == [] and len(stored["skipped"]) == 2 * len(bench_logprobs.MODES) + 2
    assert not (tmp_path / "results.png").exists()
