"""Test helper: run megatron-core 0.16.1 on CPU with gloo.

megatron-core hard-codes a few CUDA calls. Here (and only here: never in library code) they are
mapped to CPU, as listed in /work/shared/ENVIRONMENT.md:

- ``torch.cuda.current_device`` -> ``"cpu"``; ``torch.cuda.manual_seed`` / ``get_rng_state`` /
  ``set_rng_state`` -> CPU versions; ``tensor_parallel.random._get/_set_cuda_rng_state`` ->
  ``torch.get/set_rng_state``;
- for pipeline schedules and the optimizer: ``torch.cuda.synchronize`` -> no-op and a
  ``TorchFunctionMode`` mapping ``device="cuda"`` (and ``.cuda()``) to CPU;
- the attention's default causal mask (``fused_softmax.get_default_causal_mask``, made on
  ``"cuda"``) on CPU: activation recomputation calls it in the backward, outside that mode;
- ``Tensor.type()`` (no argument) of a CPU float tensor -> its ``torch.cuda.*Tensor`` name:
  megatron's distributed optimizer accepts only parameters that say they are CUDA tensors
  (``TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor, ...``); the tensors
  themselves stay on the CPU.

``spawn(fn, world, *args)`` runs ``fn(rank, world, *args)`` in ``world`` gloo processes
(MASTER_ADDR=127.0.0.1, a free port) with the patches applied in each worker.
"""
from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode


def _to_cpu_device(dev):
    if dev is None:
        return dev
    if isinstance(dev, int):
        return torch.device("cpu")
    if isinstance(dev, str) and dev.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return torch.device("cpu")
    return dev


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` keyword arguments and ``Tensor.cuda()`` to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:   # t.to("cuda") / t.to(device="cuda")
            args = tuple(_to_cpu_device(a) if isinstance(a, (str, torch.device)) else a
                         for a in args)
        return func(*args, **kwargs)


_CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
                    torch.bfloat16: "torch.cuda.BFloat16Tensor"}


def _cuda_type_name(type_fn):
    """``Tensor.type`` that names a CPU float tensor as its CUDA type when called without
    arguments (what megatron's distributed optimizer checks); any other call unchanged."""
    def type_(self, *args, **kwargs):
        if not args and not kwargs and self.device.type == "cpu" and \
                self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return type_fn(self, *args, **kwargs)
    return type_


_CUDA_NAMES = ("current_device", "manual_seed", "get_rng_state",
               "set_rng_state", "synchronize")


@contextlib.contextmanager
def cpu_patches():
    """Apply the CPU patches for the duration of the block and restore everything after."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom

    saved = {n: getattr(torch.cuda, n) for n in _CUDA_NAMES}
    saved_mask = fused_softmax.get_default_causal_mask
    # called with device="cuda" also while activation recomputation re-runs the attention in
    # the backward, where the TorchFunctionMode below is not active
    fused_softmax.get_default_causal_mask = \
        lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    saved_rng = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    saved_type = torch.Tensor.type
    torch.Tensor.type = _cuda_type_name(saved_type)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.synchronize = lambda *a, **k: None
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    try:
        with _CudaToCpu():
            yield
    finally:
        for n, f in saved.items():
            setattr(torch.cuda, n, f)
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = saved_rng
        torch.Tensor.type = saved_type
        fused_softmax.get_default_causal_mask = saved_mask


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, err_dir, fn, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        with cpu_patches():
            dist.init_process_group("gloo", rank=rank, world_size=world)
            fn(rank, world, *args)
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo CPU ranks; re-raise a rank's traceback."""
    with tempfile.TemporaryDirectory() as err_dir:
        try:
            mp.spawn(_worker, args=(world, free_port(), err_dir, fn, args), nprocs=world,
                     join=True)
        except Exception as e:
            msgs = [open(os.path.join(err_dir, n)).read() for n in sorted(os.listdir(err_dir))]
            raise AssertionError("worker failed:\n" + "\n".join(msgs)) from e


def run_single(fn, *args):
    """Run ``fn(0, 1, *args)`` in this process as a 1-rank gloo world (then tear it down)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with cpu_patches():
            return fn(0, 1, *args)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
