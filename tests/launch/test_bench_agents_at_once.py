"""benchmarks/bench_agents_at_once.py at a tiny size, in its own process (private Ray clusters):
it trains the same run with agents at once and one after another, the metrics of the two
modes are identical (the script checks it and would exit non-zero), and it reports every
phase's times for both (their ratio is the benchmark's business)."""
import json

from ._launch_helpers import run_benchmark


def test_bench_agents_at_once_tiny(tmp_path):
    proc = run_benchmark("bench_agents_at_once.py", [
        str(tmp_path), "--steps", "2", "--prompts", "2", "--group", "2", "--max-new-tokens", "4"],
        timeout=600, temp_prefix="hacpo-bench-at-once-")
    res = json.loads((tmp_path / "agents_at_once.json").read_text())
    assert res["identical_metrics"] is True and res["agents"] == 2 and res["steps"] == 2
    for mode in ("at once", "one after another"):
        got = res["seconds"][mode]
        assert set(got) == {"time/generate", "time/old_logprobs", "time/update", "time/sync",
                            "time/step"}
        assert all(len(ts) == 1 and ts[0] > 0 for ts in got.values()), got   # step 1 only
    assert all(r > 0 for r in res["ratio_p50"].values())
    assert "metrics identical in both modes" in proc.stdout


def test_bench_agents_at_once_refuses_nothing_to_measure(tmp_path):
    """--steps 1 leaves no measured step (each run's first is dropped): a usage error before
    any cluster starts, not an IndexError after every run has trained."""
    import os
    import subprocess
    import sys

    from ._launch_helpers import REPO
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_agents_at_once.py"),
                           str(tmp_path), "--steps", "1"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 2 and "--steps must be >= 2" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "agents_at_once.json").exists()
