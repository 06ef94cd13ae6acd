#!/usr/bin/env bash
# One-shot GPU check (a machine with a CUDA torch + triton preinstalled, no internet), under 8 minutes:
#   1. build taps_kernels with the CUDA extension (TAPS_CUDA=1, editable, no build isolation, no deps)
#   2. pytest -m gpu               (CUDA kernels vs references, CUDA-graph capture; a missing extension fails)
#   3. Triton tests compiled for the GPU (no interpreter)
#   4. bench/bench_kernels.py and bench/bench_tree_ops.py --quick, when present
#   5. a summary table: step, status, seconds, log file
# Every step runs under `timeout`, bounded by what is left of the overall budget.
# Usage: bash bench/gpu_check.sh     Env: PYTHON (default python), LOG_DIR (default $OUT/gpu_check or
#        bench/results/gpu_check),
#        TAPS_CUDA_ARCHS (default 90), BUDGET_S (default 470).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}
# $OUT is the folder a remote device runner brings back; logs land there when it is set.
LOG_DIR=${LOG_DIR:-${OUT:-bench/results}/gpu_check}
BUDGET_S=${BUDGET_S:-470}
export TAPS_CUDA_ARCHS=${TAPS_CUDA_ARCHS:-90}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
mkdir -p "$LOG_DIR"
# Import from the checkout even if the editable install fails (an in-place build then still loads).
export PYTHONPATH="$PWD:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
STEPS=()
FAILED=0

left() { echo $((BUDGET_S - ($(date +%s) - START))); }

# run NAME LIMIT_S CMD...: run under timeout (capped by the remaining budget), log to LOG_DIR/NAME.log.
run() {
  local name=$1 limit=$2
  shift 2
  local remain
  remain=$(left)
  if [ "$remain" -lt 10 ]; then
    STEPS+=("$name|no time|0|-")
    FAILED=1
    return 1
  fi
  [ "$limit" -gt "$remain" ] && limit=$remain
  local log="$LOG_DIR/$name.log" t0 rc status
  t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status="TIMEOUT(${limit}s)"; FAILED=1 ;;
    *) status="FAIL(rc=$rc)"; FAILED=1 ;;
  esac
  STEPS+=("$name|$status|$(($(date +%s) - t0))|$log")
  tail -n 15 "$log"
  return $rc
}

skip() { STEPS+=("$1|skipped: $2|0|-"); }

echo "=== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
$PY - <<'EOF' 2>&1
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
try:
    import triton; print("triton", triton.__version__)
except Exception as exc:
    print("triton missing:", exc)
try:
    import transformers; print("transformers", transformers.__version__)
except Exception as exc:
    print("transformers missing:", exc)
EOF

# 1. Build. pip is the documented path; if it fails fast (not a timeout), an in-place build is tried once.
if ! run build 300 env TAPS_CUDA=1 $PY -m pip install --no-build-isolation --no-deps -e .; then
  last=${STEPS[${#STEPS[@]}-1]}
  case $last in
    *TIMEOUT*|*"no time"*) ;;
    *) run build_inplace 240 env TAPS_CUDA=1 $PY setup.py build_ext --inplace ;;
  esac
fi
$PY -c "import torch, taps_kernels._C_cuda as m; print('taps_kernels._C_cuda loaded from', m.__file__)" 2>&1 | tail -n 2

# 2. GPU tests: the conftest leaves TRITON_INTERPRET unset when CUDA is present; make sure nothing else sets it.
unset TRITON_INTERPRET
export TAPS_REQUIRE_CUDA_EXT=1
run pytest_gpu 150 $PY -m pytest -m gpu -q -p no:cacheprovider tests

# 3. Triton tests, compiled for the GPU.
mapfile -t TRITON_TESTS < <(ls tests/test_triton*.py 2>/dev/null)
if [ ${#TRITON_TESTS[@]} -gt 0 ]; then
  run pytest_triton 120 $PY -m pytest -q -p no:cacheprovider -m "not slow" "${TRITON_TESTS[@]}"
else
  skip pytest_triton "no tests/test_triton*.py"
fi

# 4. Benchmarks (written elsewhere; called when present).
if [ -f bench/bench_kernels.py ]; then run bench_kernels 120 $PY bench/bench_kernels.py; else skip bench_kernels "absent"; fi
if [ -f bench/bench_tree_ops.py ]; then run bench_tree_ops 60 $PY bench/bench_tree_ops.py --quick; else skip bench_tree_ops "absent"; fi

# 5. Summary.
echo
echo "=== summary ($(($(date +%s) - START))s of ${BUDGET_S}s budget)"
printf '%-16s %-20s %8s  %s\n' step status seconds log
for row in "${STEPS[@]}"; do
  IFS='|' read -r name status secs log <<<"$row"
  printf '%-16s %-20s %8s  %s\n' "$name" "$status" "$secs" "$log"
done
for log in "$LOG_DIR"/pytest_*.log; do
  [ -f "$log" ] && printf '%-16s %s\n' "$(basename "$log" .log)" "$(grep -E '[0-9]+ (passed|failed|error)' "$log" | tail -n 1)"
done
exit $FAILED
