"""Runs a megatron CPU benchmark script at a tiny size for the tests/megatron/test_bench_*.py
checks (one gloo process per rank, one torch thread each)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_benchmark(script: str, results_dir, *args: str) -> subprocess.CompletedProcess:
    """``python benchmarks/<script> RESULTS_DIR args...``; must exit 0 (its output in the
    failure message)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), str(results_dir), *args],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
