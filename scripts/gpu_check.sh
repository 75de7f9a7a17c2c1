#!/usr/bin/env bash
# GPU checks in under 4 minutes on one GPU, with only torch, onnx and onnxruntime (CPU) installed
# there and no network. Each step has its own time limit; a step that fails or runs out is
# reported in the summary and the next one runs. Exports are reused, so each AOTInductor compile
# is paid once. Ends with one summary table (stdout and summary.txt) and one JSON file
# (gpu_check.json) in $OUT (default gpu_check/). From the repository root:
#   PYTHONPATH=. bash scripts/gpu_check.sh
# DEVICE=cpu SIZE=tiny BASE=tiny BATCHES=1,8 BATCH_RANGE=1:8:8 BASE_SEQ=1:16:16 ITERS=5 runs the same
# steps on the CPU in a few minutes (to test this script).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
TK="$PY -m tk"
OUT=${OUT:-gpu_check}
WORK=${WORK:-$(mktemp -d /tmp/tk-gpu-check.XXXXXX)}
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-small}
BASE=${BASE:-base}
BATCHES=${BATCHES:-1,32,128}
BATCH_RANGE=${BATCH_RANGE:-1:32:128}  # must hold every size of BATCHES
BASE_SEQ=${BASE_SEQ:-1:128:128}
ITERS=${ITERS:-50}
mkdir -p "$OUT" "$WORK"
STEPS="$WORK/steps.tsv"
: >"$STEPS"

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log to $WORK/NAME.log, record the outcome
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*" >&2
  local start=$SECONDS
  timeout --kill-after=5 "$limit" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  local outcome=ok
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && outcome=timeout
  [ $rc -ne 0 ] && [ "$outcome" = ok ] && outcome="failed (exit $rc)"
  printf '%s\t%s\t%s\n' "$name" "$outcome" "$((SECONDS - start))" >>"$STEPS"
  tail -n 3 "$WORK/$name.log" >&2
}

$PY -c "import torch, sys; sys.exit(0 if '$DEVICE' == 'cpu' or torch.cuda.is_available() else 1)" \
  || { echo "gpu_check: no CUDA GPU visible to torch; nothing to check" >&2; exit 1; }

SMALL="$WORK/transformer-$SIZE"
if [ "$DEVICE" = cuda ]; then
  step parity 100 $PY -m pytest -q -p no:cacheprovider -m gpu -k "not aoti" \
    tests/test_parity.py::test_parity_on_cuda tests/runtime/test_gpu_paths.py
else
  step parity 100 $PY -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_paths.py
fi
step export-small 120 $TK export transformer --size "$SIZE" --format torch --format aoti --device "$DEVICE" \
  --batch "$BATCH_RANGE" --out "$SMALL"
step bench-small 60 $TK bench "$SMALL" --engine torch,aoti --device "$DEVICE" --io device --mode reduce-overhead \
  --batch-sizes "$BATCHES" --iters "$ITERS" --warmup 5 --json "$WORK/bench_small.json"
GRAPH_FLAG=--cuda-graph
[ "$DEVICE" = cpu ] && GRAPH_FLAG=""  # CUDA graphs need CUDA: the CPU run times the same engines twice
step bench-small-graphs 60 $TK bench "$SMALL" --engine torch,aoti --device "$DEVICE" --io device --mode reduce-overhead \
  $GRAPH_FLAG --batch-sizes "$BATCHES" --iters "$ITERS" --warmup 5 --json "$WORK/bench_small_graphs.json"
step export-base 90 $TK export transformer --size "$BASE" --format torch --device "$DEVICE" --batch 1:32:32 \
  --seq "$BASE_SEQ" --out "$WORK/base-fp32" --no-check
step export-base-bf16 90 $TK export transformer --size "$BASE" --format torch --precision bf16 --device "$DEVICE" \
  --batch 1:32:32 --seq "$BASE_SEQ" --out "$WORK/base-bf16" --no-check
step bench-base 60 $TK bench "$WORK/base-fp32" --engine eager --no-baselines --device "$DEVICE" --io device --batch-sizes 32 \
  --iters 10 --warmup 2 --json "$WORK/bench_base_fp32.json"
step bench-base-bf16 90 $TK bench "$WORK/base-bf16" --engine compile,torch --no-baselines --device "$DEVICE" --io device --batch-sizes 32 \
  --iters 10 --warmup 2 --json "$WORK/bench_base_bf16.json"
step train 90 $TK train transformer --size "$SIZE" --steps 60 --device "$DEVICE" --compare --json "$WORK/train.json"

$PY scripts/gpu_summary.py "$WORK" "$OUT" | tee "$OUT/summary.txt"
