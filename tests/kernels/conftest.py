"""Kernel tests: the Triton kernels run compiled on a CUDA machine and under the Triton
interpreter on CPU. The interpreter must be switched on before triton is first imported, so it
is set here, at collection time (hacpo.kernels imports triton lazily)."""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def triton_device():
    """Device for Triton-backend tests: CUDA (compiled kernels) or CPU under the interpreter."""
    import importlib.util
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        return "cuda"
    from hacpo.kernels._common import interpreter_enabled    # imports torch only
    if not interpreter_enabled():
        pytest.skip("no CUDA and TRITON_INTERPRET is not 1: Triton kernels cannot run here")
    from hacpo.kernels import _logprobs_triton
    if not _logprobs_triton.interpreter_active():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set in this process "
                    "(run tests/kernels on its own, or export TRITON_INTERPRET=1)")
    return "cpu"
