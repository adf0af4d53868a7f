"""benchmarks/bench_logprobs.py: how its CPU peaks are measured, and a run where no case ran."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks import bench_logprobs  # noqa: E402


def test_cases_run_with_a_fixed_mmap_threshold():
    """Without it glibc keeps freed heap resident and reuses it unseen (seen: liger's
    fwd+bwd peak below its bwd-alone peak, 55 vs 74 MB, and 50-74 MB for the same case):
    every case's process has the threshold, and says so in its result."""
    spec = {"op": "logits", "impl": "naive", "mode": "both", "shape": {"T": 64, "V": 256},
            "dtype": "float32", "device": "cpu", "temperature": 1.0, "reps": 1, "warmup": 0}
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    old = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    try:
        case = bench_logprobs.case_env()
    finally:
        if old is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old
    assert case["MALLOC_MMAP_THRESHOLD_"] == str(64 * 1024)
    proc = subprocess.run([sys.executable, bench_logprobs.__file__, "--worker", json.dumps(spec)],
                          capture_output=True, text=True, timeout=300,
                          env={**env, **{k: case[k] for k in ("MALLOC_MMAP_THRESHOLD_",
                                                              "PYTHONPATH")}})
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    r = json.loads(line[len("RESULT "):])
    assert r["malloc_mmap_threshold"] == str(64 * 1024)
    assert r["peak_bytes"] > 0 and r["p20"] <= r["p50"] <= r["p80"]


def test_no_case_ran_writes_results_and_exits_1(tmp_path):
    """Every case over --case-timeout: results.json / .csv name the skipped cases and the
    run's mmap threshold, no plot (it crashed on zero rows), exit status 1."""
    rc = bench_logprobs.main(["--quick", "--ops", "logits", "--device", "cpu",
                              "--case-timeout", "0.01", "--out", str(tmp_path)])
    assert rc == 1
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["rows"] == [] and res["environment"]["malloc_mmap_threshold"] == str(64 * 1024)
    assert {(s["impl"], s["mode"]) for s in res["skipped"] if "mode" in s} == {
        (i, m) for i in ("naive", "torch") for m in bench_logprobs.MODES}
    assert (tmp_path / "results.csv").exists() and not (tmp_path / "results.png").exists()


def test_cpu_memory_and_time_are_measured_in_separate_processes(tmp_path, monkeypatch):
    """The fixed mmap threshold is for the peak only: with it, every chunk a chunked
    implementation allocates is mapped and faulted in anew, a cost users do not pay, so the
    timing runs use glibc's default malloc (a process of their own)."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    rc = bench_logprobs.main(["--quick", "--ops", "logits", "--device", "cpu", "--reps", "2",
                              "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    env = res["environment"]
    assert env["malloc_mmap_threshold"] == str(64 * 1024)
    assert env["timing_malloc_mmap_threshold"] is None
    assert len(res["rows"]) == 6
    for r in res["rows"]:
        assert r["malloc_mmap_threshold"] == str(64 * 1024), r
        assert r["timing_malloc_mmap_threshold"] is None, r
        assert r["peak_MB"] > 0 and 0 < r["p20_ms"] <= r["p50_ms"] <= r["p80_ms"], r
    # the worker's passes: memory only, time only
    spec = {"op": "logits", "impl": "torch", "mode": "fwd", "shape": {"T": 64, "V": 256},
            "dtype": "float32", "device": "cpu", "temperature": 1.0, "reps": 1, "warmup": 0}
    mem, why = bench_logprobs.run_case({**spec, "measure": "memory"}, bench_logprobs.case_env(),
                                       300)
    assert why is None and "peak_bytes" in mem and "p50" not in mem
    tim, why = bench_logprobs.run_case({**spec, "measure": "time"}, bench_logprobs.time_env(),
                                       300)
    assert why is None and "p50" in tim and "peak_bytes" not in tim
    assert tim["malloc_mmap_threshold"] is None
