#!/usr/bin/env bash
# GPU checks, on a machine with a CUDA GPU, in under 5 minutes, with what is installed there
# (it may have no network): export the small Transformer in every format the machine supports,
# check every engine against PyTorch, benchmark at batch 1, 8 and 32, compare eager and compiled
# training on the GPU, and print the tables last. Run from the repository root:
#   PYTHONPATH=. bash scripts/gpu_check.sh         (results in ${OUT:-gpu_check}/)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:-.}"
PY=${PYTHON:-python3}
TK="$PY -m tk"
OUT=${OUT:-gpu_check}
SIZE=${SIZE:-small}
mkdir -p "$OUT"
log() { echo "== $*" >&2; }

$PY - <<'PY' || { echo "gpu_check: no CUDA GPU visible to torch; nothing to check" >&2; exit 1; }
import torch
assert torch.cuda.is_available()
print("gpu:", torch.cuda.get_device_name(), "compute capability %d.%d" % torch.cuda.get_device_capability(), "torch", torch.__version__, "cuda", torch.version.cuda)
PY
$PY -c "import tensorrt" 2>/dev/null || echo "gpu_check: tensorrt is not installed here: the trt format and engine are skipped"
$PY -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null \
  || echo "gpu_check: onnxruntime has no CUDAExecutionProvider here (onnxruntime-gpu missing): the onnx engine runs on the CPU"

log "export transformer --size $SIZE --format all --device cuda"
$TK export transformer --size "$SIZE" --format all --device cuda --out "$OUT/transformer-$SIZE" --json "$OUT/export_check.json" 2>&1 | tee "$OUT/export.log"

log "check --engine all"
$TK check "$OUT/transformer-$SIZE" --engine all --device cuda --json "$OUT/check.json" 2>&1 | tee "$OUT/check.log"

log "bench at batch 1, 8, 32"
$TK bench "$OUT/transformer-$SIZE" --engine all --device cuda --batch-sizes 1,8,32 --seconds 1 \
  --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>"$OUT/bench.err" | tee "$OUT/bench.log"

log "train --compare on the GPU"
$TK train transformer --size "$SIZE" --steps 100 --device cuda --compare --json "$OUT/train_compare.json" 2>&1 | tee "$OUT/train.log"

echo
echo "================ tables ================"
for f in export check bench train; do
  echo "--- $f"
  grep -v "━" "$OUT/$f.log" | tail -n 25
done
