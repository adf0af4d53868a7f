"""Compile hacpo's Triton log-prob kernels for an NVIDIA GPU *without one* and report what the
compiled code looks like: registers, spills, shared memory, SASS instructions in the loop over
vocabulary blocks, and whether the logits loads are 128-bit.

    python benchmarks/kernel_sass.py [RESULTS_DIR] [--arch 90] [--vocab 151936]

Triton compiles for any CUDA target on a CPU machine (its wheel carries ptxas, cuobjdump):
each kernel is compiled exactly as ``hacpo.kernels._logprobs_triton`` launches it for a
``[T, vocab]`` logits tensor (``_config(vocab)``: BLOCK_V, num_warps; pointers 16-byte
aligned, integers divisible by 16 where they are), in fp32 / bf16 / fp16, the forward with and
without the entropy. This catches what the interpreter (``TRITON_INTERPRET=1``, the CPU test
path) never sees: code the compiler rejects, register spills, scalar loads, an inner loop that
grew. It measures no speed: instruction counts bound how fast a row can stream (the forward
has to keep up with HBM), the GPU benchmark (``benchmarks/gpu_check.sh``) measures it.

Runs TRITON_INTERPRET-free in its own process (``tests/kernels/test_kernel_sass.py`` calls it).
Prints a table; with RESULTS_DIR writes ``kernel_sass.json`` there. Uses triton's
compile-time API (``ASTSource``, ``GPUTarget``, the JIT function's argument binder) as pinned
in requirements (triton 3.7.1).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("kernel_sass.py compiles for a GPU: run it with TRITON_INTERPRET unset")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks._timing import positive_int, results_dir  # noqa: E402
from hacpo.kernels import _logprobs_triton as K  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _compile(kernel, args: tuple, kwargs: dict, target: GPUTarget):
    """``kernel[grid](*args, **kwargs)``'s compiled binary for ``target``, specialized as a
    launch with these arguments would be (dtypes, 16-divisible integers and pointers)."""
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, dict(kwargs), bound,
                                                              spec, opts)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def _ptxas(ptx: str, arch: int, tmp: str) -> dict:
    """ptxas -v on the PTX: registers, spill bytes, stack."""
    src = os.path.join(tmp, "k.ptx")
    with open(src, "w") as f:
        f.write(ptx)
    r = subprocess.run([os.path.join(BIN, "ptxas"), f"-arch=sm_{arch}a", "-v", src, "-o",
                        os.path.join(tmp, "k.o")], capture_output=True, text=True, check=True)
    info = r.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", info)]
    if regs is None or len(spills) != 2:
        raise RuntimeError(f"unexpected ptxas output:\n{info}")
    return {"registers": int(regs.group(1)), "spill_bytes": sum(spills)}


def _loop_instructions(cubin: bytes, tmp: str) -> int:
    """SASS instructions of the kernel's loop (from its backward branch's target to the
    branch): the work per block of BLOCK_V columns."""
    path = os.path.join(tmp, "k.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path], capture_output=True,
                          text=True, check=True).stdout
    ins = [(int(a, 16), t.strip()) for a, t in
           re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(m.group(1), 16), a) for a, t in ins
             if (m := re.search(r"\bBRA (0x[0-9a-f]+)", t))
             and int(m.group(1), 16) < a]
    if len(loops) != 1:
        raise RuntimeError(f"expected one loop in the kernel, found {len(loops)}")
    lo, hi = loops[0]
    return sum(lo <= a <= hi for a, _ in ins)


def check(arch: int = 90, vocab: int = 151936) -> list[dict]:
    target = GPUTarget("cuda", arch, 32)
    block, warps = K._config(vocab)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, dtype in DTYPES.items():
            x = torch.empty(64, dtype=dtype)                    # 16-byte aligned, like CUDA's
            tgt, f = torch.empty(8, dtype=torch.int64), torch.empty(8, dtype=torch.float32)
            runs = [(f"forward{'+entropy' if ent else ''}", K._logprob_fwd_kernel,
                     (x, vocab, tgt, f, f, f, f, vocab, 1.0),
                     dict(BLOCK_V=block, ENTROPY=ent, num_warps=warps)) for ent in (False, True)]
            runs.append(("backward", K._logprob_bwd_kernel,
                         (x, vocab, x, vocab, tgt, f, f, f, vocab, 1.0),
                         dict(BLOCK_V=block, num_warps=warps)))
            for kind, kernel, args, kwargs in runs:
                ck = _compile(kernel, args, kwargs, target)
                ptx = ck.asm["ptx"]
                rows.append({
                    "kernel": kind, "dtype": name, "arch": f"sm_{arch}", "vocab": vocab,
                    "block_v": block, "num_warps": warps, "shared_bytes": ck.metadata.shared,
                    **_ptxas(ptx, arch, tmp),
                    "loop_sass_instructions": _loop_instructions(ck.asm["cubin"], tmp),
                    "vector_loads": bool(re.search(r"ld\.global(?:\.\w+)*\.v[24]\.", ptx)),
                })
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results_dir", nargs="?")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    ap.add_argument("--vocab", type=positive_int, default=151936)
    a = ap.parse_args(argv)
    if a.results_dir:
        results_dir(ap, a.results_dir)
    rows = check(a.arch, a.vocab)
    print(f"triton {triton.__version__}, sm_{a.arch}, vocab {a.vocab}, BLOCK_V "
          f"{rows[0]['block_v']}, {rows[0]['num_warps']} warps")
    print(f"{'kernel':<18}{'dtype':<6}{'regs':>5}{'spill B':>8}{'smem B':>7}{'loop SASS':>10}"
          f"{'128-bit loads':>14}")
    for r in rows:
        print(f"{r['kernel']:<18}{r['dtype']:<6}{r['registers']:>5}{r['spill_bytes']:>8}"
              f"{r['shared_bytes']:>7}{r['loop_sass_instructions']:>10}"
              f"{'yes' if r['vector_loads'] else 'NO':>14}")
    if a.results_dir:
        with open(os.path.join(a.results_dir, "kernel_sass.json"), "w") as f:
            json.dump({"triton": triton.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
