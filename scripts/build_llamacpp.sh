#!/usr/bin/env bash
# Optional tooling (never needed by tests or CI): builds llama.cpp's llama-bench, llama-completion and
# llama-lookup from the llama-cpp-python sdist (which vendors llama.cpp) so that `taps bench --peer llamacpp`
# can measure it on the same GGUF file, and taps-llamacpp-logits (scripts/llamacpp_logits.cpp, linked against
# that build's libllama) for its logit check. Everything goes under ${TAPS_CACHE:-$HOME/.cache/taps}/llamacpp/,
# never into the repository. Idempotent: an existing download, source tree, build directory or binary is
# kept. Builds with one job (-j1 by default; set TAPS_LLAMACPP_JOBS to change it).
#
#   bash scripts/build_llamacpp.sh        # then: export TAPS_LLAMACPP_DIR=<printed bin dir> (optional)
set -euo pipefail

VERSION="${TAPS_LLAMACPP_PY_VERSION:-0.3.36}"   # llama-cpp-python sdist; vendors llama.cpp 0c1e570
JOBS="${TAPS_LLAMACPP_JOBS:-1}"
CACHE="${TAPS_CACHE:-$HOME/.cache/taps}"
DIR="$CACHE/llamacpp"
SRC="$DIR/llama_cpp_python-$VERSION"
BUILD="$DIR/build"
BIN="$BUILD/bin"
TARGETS=(llama-bench llama-completion llama-lookup)
PY="${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}"
[ -x "$PY" ] || PY=python3

mkdir -p "$DIR"

missing=()
for t in "${TARGETS[@]}"; do [ -x "$BIN/$t" ] || missing+=("$t"); done
LOGITS="$BIN/taps-llamacpp-logits"
if [ "${#missing[@]}" -eq 0 ] && [ -x "$LOGITS" ]; then
  echo "llama.cpp tools already built:"
  for t in "${TARGETS[@]}"; do echo "  $BIN/$t"; done
  echo "  $LOGITS"
  exit 0
fi

if [ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]; then
  sdist=$(ls "$DIR"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)
  if [ -z "$sdist" ]; then
    echo "downloading llama-cpp-python==$VERSION sdist into $DIR"
    "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR"
    sdist=$(ls "$DIR"/llama_cpp_python-"$VERSION".tar.gz)
  fi
  echo "unpacking $sdist"
  tar -xzf "$sdist" -C "$DIR"
fi

if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
fi

if [ "${#missing[@]}" -gt 0 ]; then
  echo "building ${missing[*]} with -j$JOBS (about 8-10 minutes on one core)"
  cmake --build "$BUILD" -j"$JOBS" --target "${missing[@]}"
fi
if [ ! -x "$LOGITS" ]; then
  LLAMA="$SRC/vendor/llama.cpp"
  "${CXX:-c++}" -O2 -std=c++17 -I"$LLAMA/include" -I"$LLAMA/ggml/include" \
    "$(cd "$(dirname "$0")" && pwd)/llamacpp_logits.cpp" -L"$BIN" -lllama -Wl,-rpath,"$BIN" -o "$LOGITS"
fi

echo "llama.cpp tools (llama-cpp-python $VERSION sdist):"
for t in "${TARGETS[@]}"; do
  [ -x "$BIN/$t" ] || { echo "missing after build: $BIN/$t" >&2; exit 1; }
  echo "  $BIN/$t"
done
echo "  $LOGITS"
