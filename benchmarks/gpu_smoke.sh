#!/usr/bin/env bash
# GPU smoke run for a CUDA machine whose python has torch + triton + transformers but maybe no
# megatron-core (and no ray / vllm: not needed here):
#   bash benchmarks/gpu_smoke.sh RESULTS_DIR [--megatron-wheel PATH] [gpu_smoke.py options]
# 2 HACPO steps with two megatron-core TP=1 policies (Llama + Qwen2 configs converted from HF)
# and the Triton log-prob kernels; per-stage timings in RESULTS_DIR/timings.json, a summary in
# RESULTS_DIR/summary.{json,txt}. Budget: < 8 minutes (the python step has a 420 s timeout).
#
# megatron-core: used if importable; otherwise the wheel given by --megatron-wheel (or
# $MEGATRON_WHEEL) is installed with `pip install --no-deps` (into the active venv, else into
# $MEGATRON_SITE, default ~/.cache/hacpo/megatron-site-pyXY, added to PYTHONPATH: `--target`
# also works under a PEP 668 "externally managed" system python). The wheel must match the
# python: megatron_core-0.16.1-cp312-*.whl for Python 3.12 (get it elsewhere with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 megatron-core==0.16.1`).
# Otherwise: a clear error, exit 2.
# PYTHON=... picks the interpreter. `--device cpu` runs the same loop on CPU (tests only: Triton
# interpreted, megatron with the test helper's CUDA patches).
set -uo pipefail
RESULTS_DIR="${1:?usage: gpu_smoke.sh RESULTS_DIR [--megatron-wheel PATH] [gpu_smoke.py options]}"
shift
WHEEL="${MEGATRON_WHEEL:-}"
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --megatron-wheel) WHEEL="${2:?--megatron-wheel needs a path}"; shift 2 ;;
    --megatron-wheel=*) WHEEL="${1#*=}"; shift ;;
    *) PASS+=("$1"); shift ;;
  esac
done
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
mkdir -p "$RESULTS_DIR"
RESULTS_DIR="$(cd "$RESULTS_DIR" && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
. "$ROOT/benchmarks/_deadline.sh"   # upto SECONDS: capped by HACPO_DEADLINE

{ nvidia-smi || true; "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"; } \
  > "$RESULTS_DIR/env.txt" 2>&1
cat "$RESULTS_DIR/env.txt"

if ! "$PY" -c "import megatron.core" 2>/dev/null; then
  if [ -z "$WHEEL" ]; then
    echo "gpu_smoke: megatron-core is not importable by $PY and no wheel was given;" \
         "pass --megatron-wheel PATH (or MEGATRON_WHEEL=PATH) to a megatron_core-0.16.1 wheel" \
         "for this python" | tee "$RESULTS_DIR/install.log" >&2
    exit 2
  fi
  if [ ! -f "$WHEEL" ]; then
    echo "gpu_smoke: megatron wheel '$WHEEL' is not a file" | tee "$RESULTS_DIR/install.log" >&2
    exit 2
  fi
  if "$PY" -c "import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)"; then
    echo "== installing $WHEEL into the venv $("$PY" -c 'import sys; print(sys.prefix)')"
    timeout "$(upto 120)" "$PY" -m pip install --no-deps --no-index "$WHEEL" 2>&1 | tee "$RESULTS_DIR/install.log"
    c=${PIPESTATUS[0]}
  else
    SITE="${MEGATRON_SITE:-$HOME/.cache/hacpo/megatron-site-py$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')}"
    echo "== installing $WHEEL into $SITE (on PYTHONPATH)"
    if "$PY" -m pip --version >/dev/null 2>&1; then
      timeout "$(upto 120)" "$PY" -m pip install --no-deps --no-index --upgrade --target "$SITE" "$WHEEL" 2>&1 \
        | tee "$RESULTS_DIR/install.log"
      c=${PIPESTATUS[0]}
    else
      # no pip for this python: a wheel is a zip of the installed tree; unpack it (after
      # checking its python tag, which pip would have checked)
      TAG="cp$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
      case "$(basename "$WHEEL")" in
        *-"$TAG"-*) echo "no pip for $PY: unpacking the wheel into $SITE" | tee "$RESULTS_DIR/install.log"
                    mkdir -p "$SITE" && "$PY" -m zipfile -e "$WHEEL" "$SITE" 2>&1 | tee -a "$RESULTS_DIR/install.log"
                    c=${PIPESTATUS[0]} ;;
        *) echo "no pip for $PY, and $(basename "$WHEEL") is no $TAG wheel" | tee "$RESULTS_DIR/install.log"
           c=3 ;;
      esac
    fi
    export PYTHONPATH="$SITE:$PYTHONPATH"
  fi
  if [ "$c" -ne 0 ]; then
    echo "gpu_smoke: pip could not install $WHEEL (rc=$c; a wheel for another python version" \
         "is 'not a supported wheel on this platform'); see $RESULTS_DIR/install.log" >&2
    exit 2
  fi
  if ! "$PY" -c "import megatron.core" 2>>"$RESULTS_DIR/install.log"; then
    echo "gpu_smoke: megatron-core still not importable after installing $WHEEL;" \
         "see $RESULTS_DIR/install.log" >&2
    exit 2
  fi
fi
"$PY" -c "import megatron.core as m; print('megatron-core', m.__version__, m.__file__)" \
  | tee -a "$RESULTS_DIR/env.txt"

echo "== 2 HACPO steps (megatron-core TP=1, Triton log-probs)"
T_SMOKE="$(upto 420)"
timeout "$T_SMOKE" "$PY" benchmarks/gpu_smoke.py "$RESULTS_DIR" "${PASS[@]}" 2>&1 | tee "$RESULTS_DIR/smoke.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 124 ] && echo "gpu_smoke: timed out after $T_SMOKE s" | tee -a "$RESULTS_DIR/summary.txt"
echo "gpu_smoke done (rc=$rc); results in $RESULTS_DIR"
exit $rc
