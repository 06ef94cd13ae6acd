#!/usr/bin/env bash
# One-shot GPU check (a machine with a CUDA torch + triton + transformers preinstalled, no network), within
# BUDGET_S seconds (default 470, under 8 minutes):
#   1. build taps_kernels with the CUDA extension (TAPS_CUDA=1, editable, no build isolation, no deps); if
#      that fails, the run goes on: Triton paths, and the PyTorch reference for the CUDA-only ops (said so)
#   2. pytest -m gpu               (CUDA kernels vs references, CUDA-graph capture)
#   3. Triton tests, compiled for the GPU (no interpreter)
#   4. decode on the kernel path: bench/bench_decode_gpu.py (SmolLM2-135M's shape, random weights; lossless
#      vs ar, per-stage CUDA-event times, host reads per round, verify-latency table, labelled projection)
#   5. microbenchmarks: bench/bench_kernels.py --quick, bench/bench_tree_ops.py --quick (CPU C++ ops)
#   6. bench/aot_resources.py for this GPU's architecture, when present
#   7. bench/bench_kernels.py's full grid, only if at least FULL_GRID_S seconds are left
#   8. ONE summary table (step, status, seconds, note) and gpu_check_summary.json
# Steps 5 (bench_tree_ops), 6 and 7 are optional: their failure is reported but does not fail the check.
# Every step runs under `timeout`: its own limit, capped by what is left of the budget minus the minimum
# slices reserved for the more important steps after it (the decode step's above all).
# Usage: bash bench/gpu_check.sh
# Env: PYTHON (default python, else python3); BUDGET_S (470); TAPS_CUDA_ARCHS (90); FULL_GRID_S (150);
#      LOG_DIR (default bench/results/gpu_check); OUT: when set, a folder collected after the run: the logs
#      and results are written to a scratch folder, and OUT receives at most six files (the summary JSON and
#      table, the decode and kernel JSONs, one .tar.gz of every log and result).
set -u
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-$(command -v python || command -v python3)}
BUDGET_S=${BUDGET_S:-470}
FULL_GRID_S=${FULL_GRID_S:-150}
PACK_DIR=${OUT:-}
if [ -n "${LOG_DIR:-}" ]; then
  :
elif [ -n "$PACK_DIR" ]; then
  LOG_DIR="$(mktemp -d)/gpu_check"
else
  LOG_DIR=bench/results/gpu_check
fi
export TAPS_CUDA_ARCHS=${TAPS_CUDA_ARCHS:-90}
MAX_JOBS=${MAX_JOBS:-$(nproc)}
export MAX_JOBS
mkdir -p "$LOG_DIR"
# Import from the checkout even if the editable install fails (an in-place build then still loads).
export PYTHONPATH="$PWD:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
START=$(date +%s)
STEPS=()
FAILED=0

left() { echo $((BUDGET_S - ($(date +%s) - START))); }

# run NAME LIMIT RESERVE CMD...: run CMD under timeout, logged to LOG_DIR/NAME.log. The limit is capped by
# the budget left minus RESERVE (seconds kept for later steps); under 10 s left for it, the step is not run.
# With OPTIONAL=<why> set for the call, a failure is reported (with that word) but does not fail the check.
run() {
  local name=$1 limit=$2 reserve=$3
  shift 3
  local avail fail=1
  [ -n "${OPTIONAL:-}" ] && fail=0
  avail=$(( $(left) - reserve ))
  if [ "$avail" -lt 10 ]; then
    STEPS+=("$name|no time|0|budget left $(left)s, ${reserve}s kept for later steps")
    [ "$fail" = 1 ] && FAILED=1
    return 1
  fi
  [ "$limit" -gt "$avail" ] && limit=$avail
  local log="$LOG_DIR/$name.log" t0 rc status
  t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status="TIMEOUT(${limit}s)" ;;
    *) status="FAIL(rc=$rc)" ;;
  esac
  [ "$rc" != 0 ] && [ "$fail" = 1 ] && FAILED=1
  [ "$rc" != 0 ] && [ "$fail" = 0 ] && status="$status,$OPTIONAL"
  STEPS+=("$name|$status|$(($(date +%s) - t0))|$(note "$name" "$log" "$rc")")
  tail -n 15 "$log"
  return $rc
}

skip() { STEPS+=("$1|skipped|0|$2"); }

# note NAME LOG RC: the summary's one-line note of a step, read from its log or its JSON.
note() {
  local name=$1 log=$2 rc=$3
  case $name in
    pytest_*) grep -E '[0-9]+ (passed|failed|error|skipped)' "$log" | tail -n 1 | tr -d '=' | sed 's/^ *//' ;;
    build*) if [ "$rc" = 0 ]; then echo "built"; else grep -E -i 'error' "$log" | tail -n 1 | cut -c1-100; fi ;;
    decode) "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["one_line"])' \
              "$LOG_DIR"/decode_gpu_*.json 2>/dev/null || tail -n 1 "$log" | cut -c1-100 ;;
    *) tail -n 1 "$log" | cut -c1-100 ;;
  esac
}

echo "=== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
"$PY" - <<'EOF' 2>&1 | tee "$LOG_DIR/environment.log"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("triton", "transformers", "safetensors"):
    try:
        print(name, __import__(name).__version__)
    except Exception as exc:
        print(name, "missing:", exc)
EOF

# Minimum seconds kept for the steps after each one (the decode step's share first).
R_DECODE=150 R_TESTS=40 R_BENCH=30

# 1. Build. pip is the documented path; if it fails fast (not a timeout), an in-place build is tried once,
#    and decides the step's verdict.
if ! OPTIONAL=fallback run build 200 $((R_TESTS + R_TESTS + R_DECODE)) \
    env TAPS_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps -e .; then
  last=${STEPS[${#STEPS[@]}-1]}
  case $last in
    *TIMEOUT*|*"no time"*) FAILED=1 ;;
    *) run build_inplace 150 $((R_TESTS + R_TESTS + R_DECODE)) env TAPS_CUDA=1 "$PY" setup.py build_ext --inplace ;;
  esac
fi
# The CUDA-extension tests fail (not skip) when it is missing; everything else goes on without it.
export TAPS_REQUIRE_CUDA_EXT=1
if "$PY" -c "import taps_kernels._C_cuda" >"$LOG_DIR/cuda_extension.log" 2>&1; then
  CUDA_EXT="loaded"
else
  CUDA_EXT="MISSING"
  echo "!!! taps_kernels._C_cuda did not build or load: continuing with the Triton paths; tree_mask,"
  echo "!!! accept_greedy and compact_kv fall back to the PyTorch reference (their GPU tests fail)."
  echo "!!! $(tail -n 1 "$LOG_DIR/cuda_extension.log")"
fi
STEPS+=("cuda_extension|$CUDA_EXT|0|taps_kernels._C_cuda $( [ "$CUDA_EXT" = loaded ] && echo imports || echo 'missing: Triton paths + reference fallbacks')")

# 2. GPU tests: the conftest leaves TRITON_INTERPRET unset when CUDA is present; make sure nothing else sets it.
unset TRITON_INTERPRET
run pytest_gpu 90 $((R_TESTS + R_DECODE)) "$PY" -m pytest -m gpu -q -p no:cacheprovider tests

# 3. Triton tests, compiled for the GPU.
mapfile -t TRITON_TESTS < <(ls tests/test_triton*.py 2>/dev/null)
if [ ${#TRITON_TESTS[@]} -gt 0 ]; then
  run pytest_triton 110 $R_DECODE "$PY" -m pytest -q -p no:cacheprovider -m "not slow" "${TRITON_TESTS[@]}"
else
  skip pytest_triton "no tests/test_triton*.py"
fi

# 4. Decode on the kernel path. Its own budget ends 25 s before the step's limit, so its JSON is written.
DECODE_LIMIT=200
avail=$(( $(left) - R_BENCH ))
[ "$DECODE_LIMIT" -gt "$avail" ] && DECODE_LIMIT=$avail
run decode "$DECODE_LIMIT" $R_BENCH "$PY" bench/bench_decode_gpu.py --device cuda --out "$LOG_DIR" \
  --budget-s $((DECODE_LIMIT > 75 ? DECODE_LIMIT - 25 : DECODE_LIMIT * 2 / 3))

# 5. Microbenchmarks (quick grids: their JSON is written before the budget ends).
if [ -f bench/bench_kernels.py ]; then
  run bench_kernels 90 15 "$PY" bench/bench_kernels.py --quick --out "$LOG_DIR"
else
  skip bench_kernels "absent"
fi
if [ -f bench/bench_tree_ops.py ]; then
  OPTIONAL=optional run bench_tree_ops 40 0 "$PY" bench/bench_tree_ops.py --quick --out "$LOG_DIR/tree_ops_cpu.json"
else
  skip bench_tree_ops "absent"
fi

# 6. Triton's own resource report for this GPU's architecture (shared memory, registers, spills).
if [ -f bench/aot_resources.py ]; then
  ARCH=$("$PY" -c "import torch; m, n = torch.cuda.get_device_capability(); print(m * 10 + n)" 2>/dev/null || echo 90)
  if "$PY" bench/aot_resources.py --help 2>/dev/null | grep -q -- "--arch"; then
    OPTIONAL=optional run aot_resources 60 0 "$PY" bench/aot_resources.py --arch "$ARCH" --out "$LOG_DIR/triton_aot_resources.json"
  else
    skip aot_resources "bench/aot_resources.py takes no --arch"
  fi
else
  skip aot_resources "bench/aot_resources.py absent"
fi

# 7. The full kernel grid (prefix up to 16384, N up to 1024, FlexAttention compiled per point), if time allows.
if [ -f bench/bench_kernels.py ] && [ "$(left)" -ge "$FULL_GRID_S" ]; then
  mkdir -p "$LOG_DIR/full_grid"
  OPTIONAL=optional run bench_kernels_full "$(left)" 0 "$PY" bench/bench_kernels.py --out "$LOG_DIR/full_grid"
else
  skip bench_kernels_full "fewer than ${FULL_GRID_S}s left"
fi

# 8. Summary: one table, one JSON; with OUT set, the files collected from it.
TOTAL=$(($(date +%s) - START))
{
  echo
  echo "=== gpu_check summary: ${TOTAL}s of ${BUDGET_S}s budget; CUDA extension: $CUDA_EXT; logs in $LOG_DIR"
  printf '%-18s %-22s %7s  %s\n' step status seconds note
  for row in "${STEPS[@]}"; do
    IFS='|' read -r name status secs text <<<"$row"
    printf '%-18s %-22s %7s  %s\n' "$name" "$status" "$secs" "$text"
  done
  echo "=== overall: $([ "$FAILED" = 0 ] && echo ok || echo FAILED)"
} | tee "$LOG_DIR/gpu_check_summary.txt"
"$PY" - "$LOG_DIR/gpu_check_summary.json" "$TOTAL" "$BUDGET_S" "$CUDA_EXT" "$FAILED" "${STEPS[@]}" <<'EOF' \
  || echo "summary JSON not written (no working python)"
import json, sys
path, total, budget, ext, failed, *rows = sys.argv[1:]
steps = [dict(zip(("step", "status", "seconds", "note"), r.split("|", 3))) for r in rows]
for s in steps:
    s["seconds"] = int(s["seconds"])
json.dump({"seconds": int(total), "budget_s": int(budget), "cuda_extension": ext, "ok": failed == "0",
           "steps": steps}, open(path, "w"), indent=1)
EOF
if [ -n "$PACK_DIR" ]; then
  mkdir -p "$PACK_DIR"
  for f in "$LOG_DIR"/gpu_check_summary.json "$LOG_DIR"/gpu_check_summary.txt "$LOG_DIR"/decode_gpu_*.json \
           "$LOG_DIR"/kernels_*.json; do
    [ -f "$f" ] && cp "$f" "$PACK_DIR/"
  done
  tar czf "$PACK_DIR/gpu_check_logs.tar.gz" -C "$(dirname "$LOG_DIR")" "$(basename "$LOG_DIR")"
  echo "=== collected in OUT: $(find "$PACK_DIR" -maxdepth 1 -type f -printf '%f ' 2>/dev/null)"
fi
exit $FAILED
