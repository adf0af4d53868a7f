#!/usr/bin/env bash
# Every GPU check of issues 3 and 5 in ONE call of the lent-GPU tool, inside its limits
# (one command <= 600 s, 15 min of device time per session, at most 8 files back from $OUT):
#
#   device tool: run(command="bash benchmarks/device_run.sh $OUT", kind="nvidia-h200",
#                    carry=[".whl"], timeout_s=600)
# (kind: issue 3's targets are an H200's; a call naming no kind gets an H100 first.)
#
# .whl/ (git-ignored, so a fresh checkout lacks it) holds megatron-core's wheel for the GPU
# machine's Python 3.12, fetched here first with `make gpu-wheels`, i.e.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 megatron-core==0.16.1 -d .whl
#
# Stages, most wanted first, each bounded so the whole stays under DEVICE_RUN_BUDGET_S (default
# 540 s, leaving the tool's 600 s limit time to pack):
#   1. correctness  compiled Triton kernels (gpu_check.sh stage "correctness", <= 150 s)   #3
#   2. smoke        2 HACPO steps, megatron-core TP=1 + Triton (gpu_smoke.sh, <= 300 s)    #5
#   3. bench        the H200 benchmark targets (gpu_check.sh stage "bench", <= 270 s)      #3
#   4. pytest       tests/kernels compiled, under pytest (only with >= 60 s left)          #3
# After every stage all results are packed into OUT/gpu-results.tar.gz (a killed run still
# returns what finished) and OUT/summary.txt gets the stage's exit status and seconds; a few
# key files are copied beside it. Commit the unpacked results under benchmarks/results/<gpu>/.
#
# Env: PYTHON (interpreter), DEVICE_RUN_BUDGET_S, DEVICE_RUN_SMOKE_ARGS (extra gpu_smoke.sh
# options), GPU_CHECK_BENCH_ARGS (extra benchmark options); DEVICE_RUN_STAGES (default
# "correctness smoke bench pytest"). Exit status: 0 if every stage ran and passed, else 1 (a
# stage that no longer fits the budget is skipped, and said).
set -uo pipefail
OUT="${1:?usage: device_run.sh OUT_DIR}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHON="$PY"
BUDGET="${DEVICE_RUN_BUDGET_S:-540}"
STAGES=" ${DEVICE_RUN_STAGES:-correctness smoke bench pytest} "
for st in $STAGES; do
  case "$st" in correctness|smoke|bench|pytest) ;;
    *) echo "device_run: unknown stage '$st' in DEVICE_RUN_STAGES" \
            "(correctness, smoke, bench, pytest)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
W="$(mktemp -d "${TMPDIR:-/tmp}/hacpo-device.XXXXXX")"
T0=$SECONDS
failed=""; skipped=""; passed=0; wanted=0
: > "$OUT/summary.txt"
echo "device_run: budget ${BUDGET}s, work dir $W, python $PY" | tee -a "$OUT/summary.txt"

left() { echo $(( BUDGET - (SECONDS - T0) )); }

pack() {
  tar czf "$OUT/gpu-results.tar.gz.part" -C "$W" . && mv "$OUT/gpu-results.tar.gz.part" "$OUT/gpu-results.tar.gz"
  local f
  for f in check/correctness.json check/results.csv smoke/summary.txt smoke/timings.json; do
    [ -f "$W/$f" ] && cp "$W/$f" "$OUT/${f//\//-}"
  done
}

skip() {
  echo "stage $1: skipped, ${2}s left of the budget" | tee -a "$OUT/summary.txt"
  skipped="$skipped $1"
}

# stage NAME MAX_SECONDS COMMAND...: run with min(MAX, time left - 15 s) as its limit
stage() {
  local name="$1" max="$2"; shift 2
  local lim=$(( $(left) - 15 ))
  [ "$lim" -gt "$max" ] && lim=$max
  if [ "$lim" -lt 30 ]; then
    skip "$name" "$lim"
    return
  fi
  echo "== stage $name (limit ${lim}s)"
  local t=$SECONDS
  # the deadline reaches the scripts' own inner `timeout`s (each in a process group of its
  # own, out of this one's reach: a hung step would hold the GPU into the next stage)
  HACPO_DEADLINE=$(( $(date +%s) + lim )) timeout "$lim" "$@" 2>&1 | tee "$W/$name.log"
  local c=${PIPESTATUS[0]}
  if [ "$c" -ne 0 ]; then failed="$failed $name"; else passed=$(( passed + 1 )); fi
  local what="rc=$c"
  [ "$c" -eq 124 ] && what="rc=124 (over its ${lim}s limit)"
  echo "stage $name: $what, $(( SECONDS - t ))s" | tee -a "$OUT/summary.txt"
  pack
}

{ nvidia-smi || true; "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"; } \
  > "$W/env.txt" 2>&1
cat "$W/env.txt" >> "$OUT/summary.txt"

WHEEL_ARGS=()
SITE_MADE=""
if ! "$PY" -c "import megatron.core" 2>/dev/null; then
  tag="cp$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
  whl=$(ls "$ROOT"/.whl/megatron_core-0.16.1-"$tag"-*.whl 2>/dev/null | head -1)
  if [ -n "$whl" ]; then
    WHEEL_ARGS=(--megatron-wheel "$whl")
    # a fresh install target per run (gpu_smoke.sh installs there when the python is no venv),
    # outside $W: the results tarball holds results only
    if [ -z "${MEGATRON_SITE:-}" ]; then
      MEGATRON_SITE="$(mktemp -d "${TMPDIR:-/tmp}/hacpo-megatron-site.XXXXXX")"
      SITE_MADE=1
    fi
    export MEGATRON_SITE
  else
    echo "device_run: no megatron-core for $PY and no .whl/megatron_core-0.16.1-$tag-*.whl" \
         "(carry .whl; see the header): the smoke stage will say so" | tee -a "$OUT/summary.txt"
  fi
fi

cd "$ROOT"
# shellcheck disable=SC2086
for st in correctness smoke bench pytest; do
  [[ "$STAGES" == *" $st "* ]] || continue
  wanted=$(( wanted + 1 ))
  case "$st" in
    correctness) stage correctness 150 env GPU_CHECK_STAGES=correctness \
                   bash benchmarks/gpu_check.sh "$W/check" ;;
    smoke)       stage smoke 300 bash benchmarks/gpu_smoke.sh "$W/smoke" "${WHEEL_ARGS[@]}" \
                   ${DEVICE_RUN_SMOKE_ARGS:-} ;;
    bench)       stage bench 280 env GPU_CHECK_STAGES=bench bash benchmarks/gpu_check.sh "$W/check" ;;
    pytest)      if [ "$(left)" -ge 75 ]; then
                   stage pytest 130 env GPU_CHECK_STAGES=pytest bash benchmarks/gpu_check.sh "$W/check"
                 else
                   skip pytest "$(left)"
                 fi ;;
  esac
done
pack
rm -rf "$W"
[ -n "${SITE_MADE:-}" ] && rm -rf "$MEGATRON_SITE"
echo "device_run: done in $(( SECONDS - T0 ))s, $passed of $wanted stages passed${failed:+ (failed:$failed)}${skipped:+ (skipped:$skipped)}; results in $OUT" \
  | tee -a "$OUT/summary.txt"
[ "$passed" -eq "$wanted" ]
