"""benchmarks/gpu_smoke.sh end to end in its CPU mode (``--device cpu``): the same 2-step HACPO
loop as on a GPU (two megatron-core TP=1 policies, Triton log-prob kernels under
TRITON_INTERPRET=1, megatron with the test helper's CUDA patches), then its result files."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")
pytest.importorskip("triton", reason="triton is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(out, *args, env=None):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("TRITON_INTERPRET", None)     # the script sets it itself in CPU mode
    return subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_smoke.sh"), str(out),
                           *args], capture_output=True, text=True, env=env, timeout=300)


def test_gpu_smoke_cpu_mode(tmp_path):
    out = tmp_path / "results"
    proc = _run(out, "--device", "cpu")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is True
    assert summary["device"] == "cpu" and summary["steps"] == 2
    assert summary["logprob_backend"] == summary["logprob_backend_resolved"] == "triton"
    assert summary["megatron_core"] == "0.16.1" and summary["lm_head"] == "fused"
    checks = summary["checks"]
    for agent in ("llama", "qwen2"):
        for check in ("weights_roundtrip_exact", "logprobs_match_hf", "lm_heads_agree",
                      "token_budget_agrees", "recompute_agrees", "distributed_optimizer_agrees",
                      "weights_changed_and_finite"):
            assert checks[f"{agent}/{check}"] is True, (agent, check)
        # fp32, torch vs Triton-interpreted log-softmax: ~5e-7 seen
        assert summary["logprob_max_abs_err_vs_hf"][agent] < 1e-4
        assert summary["logprob_max_abs_diff_lm_heads"][agent] < 1e-4
        assert summary["max_weight_change"][agent] > 0
        # fp32 on CPU: recomputation re-runs the same ops (seen: 0)
        assert summary["grad_max_rel_diff_recompute"][agent] <= 1e-5
        # fp32 on CPU, DP=1: the same Adam update on the same gradients (seen: 0)
        assert summary["weight_max_rel_diff_distributed_optimizer"][agent] <= 1e-5
    assert checks["losses_and_logprobs_finite"] is True

    timings = json.loads((out / "timings.json").read_text())
    assert [t["step"] for t in timings] == [0, 1]
    stages = ["reward", "capability"] + [f"{s}/{a}" for s in ("generate", "old_logprobs",
                                                             "advantages", "update")
                                         for a in ("llama", "qwen2")]
    for t in timings:
        for s in stages:
            assert t[f"time/{s}"] >= 0, s
        assert t["time/update/llama"] > 0 and t["time/step"] > 0
        # no stage can take longer than the whole step
        assert max(t[f"time/{s}"] for s in stages) <= t["time/step"]
        assert all(0.0 <= r <= 1.0 for r in t["reward_mean"].values())
        assert all(len(t[f"loss/{a}"]) >= 1 for a in ("llama", "qwen2"))
    text = (out / "summary.txt").read_text()
    assert text.startswith("gpu_smoke: PASS on cpu") and "step 1:" in text
    assert "megatron-core" in (out / "env.txt").read_text()


def test_gpu_smoke_missing_wheel_is_a_clear_error(tmp_path):
    """A wheel path that does not exist: exit 2 naming it (the check runs only when
    megatron-core is not importable, so point PYTHON at an interpreter without it)."""
    env_py = tmp_path / "py"
    env_py.write_text("#!/bin/sh\nexec %s -S \"$@\"\n" % sys.executable)   # -S: no site dirs
    env_py.chmod(0o755)
    proc = _run(tmp_path / "r", "--megatron-wheel", str(tmp_path / "nope.whl"),
                env={"PYTHON": str(env_py)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"megatron wheel '{tmp_path / 'nope.whl'}' is not a file" in proc.stderr
    proc = _run(tmp_path / "r", env={"PYTHON": str(env_py), "MEGATRON_WHEEL": ""})
    assert proc.returncode == 2
    assert "megatron-core is not importable" in proc.stderr and "--megatron-wheel" in proc.stderr
