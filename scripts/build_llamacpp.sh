#!/usr/bin/env bash
# Build llama.cpp's `llama-server`, `llama-quantize` and `llama-perplexity` (quality of a GGUF) at the commit tuner's llama.cpp exporter targets
# (0c1e57098), from the llama-cpp-python 0.3.36 sdist on PyPI (it vendors that tree; no prebuilt server is on the
# registries this project may reach). Cached outside the repo and rebuilt only when missing: ~5.5 min on 2 cores.
#   usage: scripts/build_llamacpp.sh [PIP]        (PIP: the pip to download the sdist with; default: pip3)
# Prints the bin directory on success. Exit 1 with one line naming what is missing or what failed.
set -euo pipefail
VERSION=0.3.36
COMMIT=0c1e57098
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
PIP=${1:-pip3}
ROOT=${TUNER_CACHE:-$HOME/.cache/tuner}/llama.cpp/$COMMIT
BIN=$ROOT/bin
if [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-quantize" ] && [ -x "$BIN/llama-perplexity" ]; then echo "$BIN"; exit 0; fi
for tool in cmake ninja g++; do
  command -v "$tool" >/dev/null || { echo "build_llamacpp: $tool not found (apt-get install cmake ninja-build g++)" >&2; exit 1; }
done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tuner-llamacpp.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
"$PIP" download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$WORK" 2>"$WORK/pip.log" \
  || { echo "build_llamacpp: pip download llama-cpp-python==$VERSION failed: $(tail -1 "$WORK/pip.log")" >&2; exit 1; }
SDIST="$WORK/llama_cpp_python-$VERSION.tar.gz"
echo "$SHA256  $SDIST" | sha256sum --check --status \
  || { echo "build_llamacpp: $SDIST sha256 differs from $SHA256 (refusing to build it)" >&2; exit 1; }
tar -xzf "$SDIST" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
LOG="$ROOT.build.log"
mkdir -p "$(dirname "$ROOT")"
echo "build_llamacpp: building llama-server, llama-quantize and llama-perplexity ($COMMIT) into $BIN (~5 min; log $LOG)" >&2
if ! { cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
         -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
         -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
       && cmake --build "$WORK/build" --target llama-server llama-quantize llama-perplexity -j "$(nproc)"; } >"$LOG" 2>&1; then
  echo "build_llamacpp: build failed: $(grep -m1 -i 'error' "$LOG" || tail -1 "$LOG") (log $LOG)" >&2; exit 1
fi
mkdir -p "$ROOT.tmp/bin"
cp "$WORK/build/bin/llama-server" "$WORK/build/bin/llama-quantize" "$WORK/build/bin/llama-perplexity" "$ROOT.tmp/bin/"
echo "$COMMIT" >"$ROOT.tmp/COMMIT"
rm -rf "$ROOT" && mv "$ROOT.tmp" "$ROOT"   # appears whole or not at all
echo "$BIN"
