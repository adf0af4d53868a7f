#!/usr/bin/env bash
# One command for a CUDA machine (python with torch + triton; hacpo not installed, liger and
# pytest optional):   bash benchmarks/gpu_check.sh RESULTS_DIR
# 1. compiled Triton correctness checks (benchmarks/gpu_correctness.py, no pytest needed)
# 2. the kernel test files under pytest if pytest is there (TRITON_INTERPRET unset)
# 3. the benchmark at the GPU shapes, incl. device-to-device copy bandwidth
# Budget: < 8 minutes in all (each step has its own timeout). Logs + data go to RESULTS_DIR.
# GPU_CHECK_BENCH_ARGS="--quick" (env) adds benchmark flags, e.g. for a smoke test.
# GPU_CHECK_STAGES (env; default "correctness pytest bench") runs only the stages named, and
# GPU_CHECK_BENCH_TIMEOUT (seconds, default 270) bounds the benchmark: benchmarks/device_run.sh
# runs the stages apart, between other work, inside one budget.
set -uo pipefail
RESULTS_DIR="${1:?usage: gpu_check.sh RESULTS_DIR}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
mkdir -p "$RESULTS_DIR"
RESULTS_DIR="$(cd "$RESULTS_DIR" && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
cd "$ROOT"
rc=0
. "$ROOT/benchmarks/_deadline.sh"   # upto SECONDS: capped by HACPO_DEADLINE
STAGES=" ${GPU_CHECK_STAGES:-correctness pytest bench} "
for st in $STAGES; do
  case "$st" in correctness|pytest|bench) ;;
    *) echo "gpu_check: unknown stage '$st' in GPU_CHECK_STAGES (correctness, pytest, bench)" >&2
       exit 2 ;;
  esac
done

{ nvidia-smi || true; "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"; } \
  > "$RESULTS_DIR/env.txt" 2>&1
cat "$RESULTS_DIR/env.txt"

if [[ "$STAGES" == *" correctness "* ]]; then
echo "== 1/3 compiled Triton correctness"
timeout "$(upto 150)" "$PY" benchmarks/gpu_correctness.py "$RESULTS_DIR" 2>&1 | tee "$RESULTS_DIR/correctness.log"
c=${PIPESTATUS[0]}; [ "$c" -ne 0 ] && rc=$c
fi

if [[ "$STAGES" == *" pytest "* ]]; then
echo "== 2/3 pytest tests/kernels (not multiprocess)"
if "$PY" -c "import pytest" 2>/dev/null; then
  # -o addopts= : the repo's pytest.ini asks for pytest-timeout, which may be absent here
  timeout "$(upto 120)" "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -m "not multiprocess" \
    tests/kernels 2>&1 | tee "$RESULTS_DIR/pytest.log"
  c=${PIPESTATUS[0]}; [ "$c" -ne 0 ] && rc=$c
else
  echo "pytest not installed: skipped (step 1 ran the same checks without it)" | tee "$RESULTS_DIR/pytest.log"
fi
fi

if [[ "$STAGES" == *" bench "* ]]; then
echo "== 3/3 benchmark"
"$PY" -c "import liger_kernel" 2>/dev/null || echo "liger_kernel not installed: its columns are skipped"
timeout "$(upto "${GPU_CHECK_BENCH_TIMEOUT:-270}")" "$PY" benchmarks/bench_logprobs.py --out "$RESULTS_DIR" \
  --reps 10 --case-timeout 60 ${GPU_CHECK_BENCH_ARGS:-} 2>&1 \
  | tee "$RESULTS_DIR/bench.log"
c=${PIPESTATUS[0]}; [ "$c" -ne 0 ] && rc=$c
fi
echo "gpu_check done (rc=$rc); results in $RESULTS_DIR"
exit $rc
