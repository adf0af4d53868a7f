"""tests/_strict_skips.py: under CI on a CPU machine, a skip whose reason is not "needs a GPU"
fails the session (a dependency that did not install must not pass CI as a skip)."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TESTS = '''
import pytest
def test_runs(): pass
def test_gpu(): pytest.skip("needs a CUDA GPU with >= 16 GB free")
def test_gpu_mark(): pass
test_gpu_mark = pytest.mark.skipif(True, reason="needs a GPU (and a CUDA build of vLLM)")(
    test_gpu_mark)
@pytest.mark.xfail(reason="not a skip")
def test_xfail(): assert False
'''


def _pytest(tmp_path, extra: str, **env):
    (tmp_path / "test_some.py").write_text(_TESTS + extra)
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "HACPO_STRICT_SKIPS")}
    clean["PYTHONPATH"] = ROOT
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "tests._strict_skips", str(tmp_path / "test_some.py")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**clean, **env})


_MISSING_DEP = '''
def test_dep():
    pytest.importorskip("no_such_module_hacpo", reason="needs no_such_module_hacpo (not installed)")
'''


def test_a_skip_for_a_missing_dependency_fails_strict_runs(tmp_path):
    out = _pytest(tmp_path, _MISSING_DEP, HACPO_STRICT_SKIPS="1")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 test(s) skipped for a reason other than needing a GPU" in out.stdout
    # the one test named: not the GPU skips, not the xfail
    assert [ln for ln in out.stdout.splitlines() if ln.startswith("  test_some.py::")] == [
        "  test_some.py::test_dep: needs no_such_module_hacpo (not installed)"]
    # CI on this machine: strict unless it has a GPU
    ci = _pytest(tmp_path, _MISSING_DEP, CI="true")
    assert ci.returncode == (0 if torch.cuda.is_available() else 1), ci.stdout + ci.stderr
    assert _pytest(tmp_path, _MISSING_DEP).returncode == 0                    # not CI
    assert _pytest(tmp_path, _MISSING_DEP, CI="true",
                   HACPO_STRICT_SKIPS="0").returncode == 0                  # turned off


def test_gpu_skips_pass_strict_runs_and_failures_keep_their_status(tmp_path):
    out = _pytest(tmp_path, "", HACPO_STRICT_SKIPS="1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 skipped" in out.stdout and "1 xfailed" in out.stdout
    failing = _pytest(tmp_path, _MISSING_DEP + "def test_bad(): assert False\n",
                      HACPO_STRICT_SKIPS="1")
    assert failing.returncode == pytest.ExitCode.TESTS_FAILED
    assert "1 failed" in failing.stdout and "skipped for a reason other" in failing.stdout
