"""The benchmark scripts' shared percentile rule, and their usage errors: bad arguments and a
results path that is a file are a one-line ``error:`` with exit status 2 before anything is
measured (they were tracebacks, some after minutes of work, or silently other settings)."""
import importlib
import os
import random
import statistics
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _timing  # noqa: E402


def test_percentiles_interpolate_linearly_like_numpy():
    """One rule for every script (they rounded the rank half to even, or half up): p50 of an
    even count is the mean of the middle two, as statistics.median and numpy say."""
    assert _timing.pct([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert _timing.pct([0.0, 1.0, 2.0, 3.0, 4.0], 0.2) == pytest.approx(0.8)
    rng = random.Random(0)
    for n in (1, 2, 3, 5, 6, 7, 10):
        xs = [rng.random() for _ in range(n)]
        assert _timing.pct(xs, 0.5) == pytest.approx(statistics.median(xs))
        for q in _timing.QUANTILES:
            assert _timing.pct(xs, q) == pytest.approx(float(np.percentile(xs, 100 * q)))


@pytest.mark.parametrize("script", ["bench_algorithms", "bench_logprobs",
                                    "bench_rollout_agents", "bench_decoder_fast_paths",
                                    "bench_policy_lm_head", "bench_agents_at_once"])
def test_every_script_takes_the_shared_percentile(script):
    mod = importlib.import_module(f"benchmarks.{script}")
    assert mod.pct is _timing.pct


def _boom(*_a, **_k):
    raise AssertionError("measured before the arguments were checked")


# (script, what its measurement starts with: module, attribute), argv, what the error says
CASES = [
    ("bench_logprobs", ("environment",), ["--ops", "bogus", "--device", "cpu"], "--ops"),
    ("bench_logprobs", ("environment",), ["--dtype", "bogus"], "--dtype"),
    ("bench_logprobs", ("environment",), ["--reps", "0", "--device", "cpu"], "--reps"),
    ("bench_logprobs", ("environment",), ["--out", "{file}", "--device", "cpu"], "{file}"),
    ("bench_logprobs", ("environment",), ["--case-timeout", "-1", "--device", "cpu"],
     "--case-timeout"),
    ("bench_logprobs", ("environment",), ["--case-timeout", "0", "--device", "cpu"],
     "--case-timeout"),
    ("bench_algorithms", ("make_pool",), ["--json", "{file}/r.json"], "{file}"),
    ("bench_algorithms", ("make_pool",), ["--json", "{dir}"], "{dir}"),
    ("bench_policy_lm_head", None, ["--reps", "0"], "--reps"),
    ("bench_policy_lm_head", None, ["--json", "{dir}"], "{dir}"),
    ("bench_decoder_fast_paths", ("hacpo.engine.run_config", "load_config"),
     ["--json", "{file}/r.json"], "{file}"),
    ("bench_generation_syncs", ("load_baseline",), ["--baseline", "HEAD", "--reps", "0"],
     "--reps"),
    ("bench_generation_syncs", ("load_baseline",),
     ["--baseline", "HEAD", "--max-new-tokens", "0"], "--max-new-tokens"),
    ("bench_generation_syncs", ("load_baseline",), ["{file}", "--baseline", "HEAD"], "{file}"),
    ("bench_generation_syncs", ("load_baseline",), ["--baseline", "HEAD", "--temperature",
                                                    "-1"], "--temperature"),
    ("bench_generation_syncs", ("load_baseline",), ["--baseline", "HEAD", "--temperature",
                                                    "nan"], "--temperature"),
    ("bench_generation_syncs", ("load_baseline",), ["--baseline", "HEAD", "--top-p", "0"],
     "--top-p"),
    ("bench_generation_syncs", ("load_baseline",), ["--baseline", "HEAD", "--device", "bogus"],
     "--device"),
    ("bench_agents_at_once", ("hacpo.engine.trainer", "train"), ["{file}"], "{file}"),
    ("bench_rollout_agents", ("hacpo.engine.build", "load_data"), ["{file}"], "{file}"),
    ("bench_rollout_agents", ("hacpo.engine.build", "load_data"), ["--d-model", "-8"],
     "--d-model"),
    ("bench_rollout_agents", ("hacpo.engine.build", "load_data"), ["--layers", "-1"],
     "--layers"),
    ("bench_weight_pull", ("tests.megatron._cpu_megatron", "spawn"), ["{file}"], "{file}"),
    ("bench_weight_pull", ("tests.megatron._cpu_megatron", "spawn"),
     ["{dir}", "--buckets", "0", "-1"], "--buckets"),
    ("bench_megatron_lm_head", ("run_modes",), ["{file}"], "{file}"),
    ("bench_megatron_lm_head", ("run_modes",), ["{dir}", "--tp", "0"], "--tp"),
    ("bench_megatron_micro_batches", ("run_modes",), ["{file}/sub"], "{file}"),
    ("bench_megatron_activations", ("run_modes",), ["{file}"], "{file}"),
    ("bench_megatron_optimizer", ("run_modes",), ["{file}"], "{file}"),
    ("bench_megatron_optimizer", ("run_modes",), ["{dir}", "--hidden", "0"], "--hidden"),
]


@pytest.mark.parametrize("script, measure, argv, says", CASES,
                         ids=[f"{c[0]}:{' '.join(c[2])}" for c in CASES])
def test_usage_errors_come_before_any_measurement(script, measure, argv, says, tmp_path,
                                                  monkeypatch, capsys):
    mod = importlib.import_module(f"benchmarks.{script}")
    if measure is None:                      # the script measures in subprocesses
        monkeypatch.setattr(mod.subprocess, "run", _boom)
    elif len(measure) == 1:
        monkeypatch.setattr(mod, measure[0], _boom)
    else:
        monkeypatch.setattr(importlib.import_module(measure[0]), measure[1], _boom)
    afile = tmp_path / "a-file"
    afile.write_text("")
    paths = {"file": str(afile), "dir": str(tmp_path)}
    with pytest.raises(SystemExit) as e:
        mod.main([a.format(**paths) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()   # usage, then the one-line error
    assert e.value.code == 2 and ": error: " in err[-1] and says.format(**paths) in err[-1]


def test_results_locations_and_their_parents_are_created(tmp_path):
    import argparse

    ap = argparse.ArgumentParser()
    d = tmp_path / "x" / "y"
    assert _timing.results_dir(ap, str(d)) == str(d) and d.is_dir()
    f = tmp_path / "z" / "r.json"
    assert _timing.results_file(ap, str(f)) == str(f) and f.parent.is_dir() and not f.exists()
