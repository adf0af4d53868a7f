"""benchmarks/bench_decoder_fast_paths.py at a tiny size: the fast paths and the reference code
run side by side on the default run's two policies and give the same bits (the timings are the
benchmark's business)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_decoder_fast_paths_tiny(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks",
                                                        "bench_decoder_fast_paths.py"),
                           "--reps", "1", "--prompts", "2", "--threads", "1",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["same_results"] is True and r["reps"] == 1
    assert set(r["rows"]) == {f"{a}/{s}" for a in ("char-small", "qwen3-large")
                              for s in ("generate", "old_logprobs", "update", "total")}
    for row in r["rows"].values():
        assert len(row["old"]) == len(row["new"]) == 3 and row["ratio_p50"] > 0
    assert "results bit-identical: yes" in proc.stdout


def test_bench_decoder_fast_paths_bad_arguments():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks",
                                                        "bench_decoder_fast_paths.py"),
                           "--reps", "0"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2 and "--reps" in proc.stderr
