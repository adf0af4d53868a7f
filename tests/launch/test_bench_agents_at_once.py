"""benchmarks/bench_agents_at_once.py at a tiny size, in its own process (private Ray clusters):
it trains the same run with agents at once and one after another, the metrics of the two
modes are identical (the script checks it and would exit non-zero), and it reports every
phase's times for both (their ratio is the benchmark's business)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_agents_at_once_tiny(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_agents_at_once.py"),
         str(tmp_path), "--steps", "2", "--prompts", "2", "--group", "2",
         "--max-new-tokens", "4"],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "agents_at_once.json").read_text())
    assert res["identical_metrics"] is True and res["agents"] == 2 and res["steps"] == 2
    for mode in ("at once", "one after another"):
        got = res["seconds"][mode]
        assert set(got) == {"time/generate", "time/update", "time/sync", "time/step"}
        assert all(len(ts) == 1 and ts[0] > 0 for ts in got.values()), got   # step 1 only
    assert all(r > 0 for r in res["ratio_p50"].values())
    assert "metrics identical in both modes" in proc.stdout
