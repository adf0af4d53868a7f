"""Suite-wide setup. Without a GPU, Triton kernels run under the interpreter, which must be
enabled before anything imports triton (liger-kernel and hacpo.kernels' Triton module do), so
it is set here, before any test module is collected."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
