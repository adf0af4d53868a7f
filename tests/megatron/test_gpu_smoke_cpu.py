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


def _python_without_pip_or_megatron(tmp_path):
    """An interpreter as on the GPU machine: no venv, no pip, no megatron-core (this venv's
    python behind a wrapper; megatron is importable only from outside site-packages)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name != 'megatron':\n"
        "            return None\n"
        "        import importlib.machinery\n"
        "        spec = importlib.machinery.PathFinder.find_spec(name, path)\n"
        "        locs = list(spec.submodule_search_locations or []) if spec else []\n"
        "        if not [p for p in locs if 'site-packages' not in p]:\n"
        "            raise ModuleNotFoundError(\"No module named 'megatron'\")\n"
        "        return spec\n"
        "sys.meta_path.insert(0, _Hide())\n")
    py = tmp_path / "python"
    py.write_text("#!/bin/sh\n"
                  "case \"$*\" in *'-m pip'*) echo 'No module named pip' >&2; exit 1;; esac\n"
                  "case \"$*\" in *'sys.base_prefix'*) exit 1;; esac\n"     # "no venv"
                  f"PYTHONPATH=\"{hide}${{PYTHONPATH:+:$PYTHONPATH}}\" exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    return py


def _wheel_of_installed_megatron(tmp_path):
    """A wheel-shaped zip of the installed megatron package (CI downloads nothing), named with
    this python's tag."""
    import zipfile

    import megatron.core
    pkg = os.path.dirname(os.path.dirname(megatron.core.__file__))     # .../megatron
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    whl = tmp_path / f"megatron_core-0.16.1-{tag}-{tag}-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for d, _, files in os.walk(pkg):
            for f in files:
                if not f.endswith(".pyc"):
                    p = os.path.join(d, f)
                    z.write(p, os.path.relpath(p, os.path.dirname(pkg)))
    return whl


def test_gpu_smoke_installs_the_wheel_without_pip(tmp_path):
    """The GPU machine's python may have no pip: the wheel is unpacked into MEGATRON_SITE
    and the run uses megatron from there."""
    py = _python_without_pip_or_megatron(tmp_path)
    check = subprocess.run([str(py), "-c", "import megatron.core"], capture_output=True,
                           text=True)
    assert check.returncode != 0 and "No module named 'megatron'" in check.stderr
    site = tmp_path / "site"
    out = tmp_path / "r"
    proc = _run(out, "--device", "cpu", "--megatron-wheel", str(_wheel_of_installed_megatron(
        tmp_path)), env={"PYTHON": str(py), "MEGATRON_SITE": str(site)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"no pip for {py}: unpacking the wheel into {site}" in proc.stdout
    assert str(site / "megatron" / "core") in (out / "env.txt").read_text()
    assert json.loads((out / "summary.json").read_text())["ok"] is True
    # a wheel for another python is refused (pip would say "not a supported wheel")
    other = tmp_path / "megatron_core-0.16.1-cp27-cp27-manylinux_2_28_x86_64.whl"
    other.write_bytes(b"")
    proc = _run(tmp_path / "r2", "--device", "cpu", "--megatron-wheel", str(other),
                env={"PYTHON": str(py), "MEGATRON_SITE": str(tmp_path / "site2")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "is no cp3" in proc.stdout and "pip could not install" in proc.stderr


def test_device_run_packs_every_stage_into_few_files(tmp_path):
    """benchmarks/device_run.sh (the one command for a lent GPU) in CPU mode: each stage's
    status and time in summary.txt, everything in one tarball (the device tool returns at
    most 8 files, 2 folders deep), and stages that no longer fit the budget skipped."""
    import tarfile

    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "DEVICE_RUN_SMOKE_ARGS": "--device cpu", "DEVICE_RUN_STAGES": "correctness smoke bench",
           "GPU_CHECK_BENCH_ARGS": "--quick --device cpu --ops logits --reps 2",
           "TMPDIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "device_run.sh"), str(out)],
                          capture_output=True, text=True, env=env, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (out / "summary.txt").read_text()
    for st in ("correctness", "smoke", "bench"):
        assert f"stage {st}: rc=0, " in summary, summary
    assert "3 of 3 stages passed" in summary
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(p.is_file() for p in out.iterdir()), files
    with tarfile.open(out / "gpu-results.tar.gz") as t:
        names = set(t.getnames())
    for f in ("./smoke/summary.json", "./smoke/timings.json", "./check/results.csv",
              "./check/bench.log", "./check/correctness.log", "./env.txt"):
        assert f in names, (f, sorted(names))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("hacpo-device.")]  # cleaned
    # a budget too small for any stage (each needs 30 s + 15 s to pack): every stage is
    # skipped, and said, and the run does not pass
    out2 = tmp_path / "out2"
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "device_run.sh"), str(out2)],
                          capture_output=True, text=True, timeout=400,
                          env={**env, "DEVICE_RUN_BUDGET_S": "40"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (out2 / "summary.txt").read_text()
    for st in ("correctness", "smoke", "bench"):
        assert f"stage {st}: skipped, " in summary, summary
    assert "0 of 3 stages passed (skipped: correctness smoke bench)" in summary, summary
    assert (out2 / "gpu-results.tar.gz").is_file()


@pytest.mark.parametrize("script, stuck, env", [
    ("gpu_check.sh", "bench_logprobs.py", {"GPU_CHECK_STAGES": "bench"}),
    ("gpu_smoke.sh", "gpu_smoke.py", {})])
def test_inner_time_limits_follow_the_stage_deadline(tmp_path, script, stuck, env):
    """device_run.sh bounds each stage with `timeout`, which cannot reach the scripts' own
    inner `timeout`s (each runs its command in a process group of its own): a hung step
    would hold the GPU into the next stage. The stage's deadline (HACPO_DEADLINE) lowers
    them: a step stuck for 120 s ends ~5 s before a deadline 15 s away."""
    import time

    py = tmp_path / "python"
    py.write_text("#!/bin/sh\n"
                  f"case \"$*\" in *{stuck}*) exec sleep 120;; esac\n"
                  f"exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "benchmarks", script), str(tmp_path / "r")],
        capture_output=True, text=True, timeout=110,
        env={**os.environ, "PYTHON": str(py), **env,
             "HACPO_DEADLINE": str(int(time.time()) + 15)})
    took = time.monotonic() - t0
    assert proc.returncode == 124, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert took < 60, took            # the inner limit was 270 / 420 s without the deadline
