"""benchmarks/bench_policy_lm_head.py at a tiny size: both modes run in their own process and
agree (the numbers are the benchmark's business)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_policy_lm_head_tiny(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks",
                                                        "bench_policy_lm_head.py"),
                           "--T", "64", "--H", "16", "--V", "300", "--reps", "1",
                           "--threads", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["same_results"] and set(r["rows"]) == {"logits", "fused"}
    assert all(len(v["seconds"]) == 1 and v["peak_mib"] >= 0 for v in r["rows"].values())
    assert "fused / logits: time" in proc.stdout
