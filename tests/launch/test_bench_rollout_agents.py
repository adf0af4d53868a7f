"""benchmarks/bench_rollout_agents.py at a tiny size, in its own process (its own private Ray
cluster): it runs, both modes sample the same rollouts (the script checks it and would exit
non-zero), both sync weights, and it reports both modes' times for each phase (their ratio is
the benchmark's business)."""
import json

from ._launch_helpers import run_benchmark


def test_bench_rollout_agents_tiny(tmp_path):
    proc = run_benchmark("bench_rollout_agents.py", [
        str(tmp_path), "--reps", "2", "--prompts", "2", "--group", "2", "--max-new-tokens", "4",
        "--sync-reps", "2"], temp_prefix="hacpo-bench-rollout-")
    res = json.loads((tmp_path / "rollout_agents.json").read_text())
    assert res["agents"] == 2 and res["reps"] == 2 and res["tokens_per_call"] > 0
    assert {m: len(ts) for m, ts in res["seconds"].items()} == {"at once": 2,
                                                               "one after another": 2}
    assert all(t > 0 for ts in res["seconds"].values() for t in ts)
    assert res["ratio_p50"] > 0 and "one after another / at once (p50)" in proc.stdout
    sy = res["sync"]                                   # the weight sync, both modes
    assert sy["reps"] == 2 and sy["weight_bytes"] > 0
    assert {m: len(ts) for m, ts in sy["seconds"].items()} == {"at once": 2,
                                                              "one after another": 2}
    assert all(t > 0 for ts in sy["seconds"].values() for t in ts) and sy["ratio_p50"] > 0


def test_bench_rollout_agents_refuses_zero_reps(tmp_path):
    """--reps 0 times nothing: a usage error before the cluster starts (was a NameError after
    it)."""
    import os
    import subprocess
    import sys

    from ._launch_helpers import REPO
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_rollout_agents.py"),
                           str(tmp_path), "--reps", "0"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 2 and "--reps must be >= 1" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "rollout_agents.json").exists()
