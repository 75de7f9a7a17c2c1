#!/usr/bin/env bash
# The main job: set up, train the Transformer briefly (keeping 64 held-out samples of its task), then
# `tk optimize` it on those samples: every format and precision this machine can run is exported, judged
# against PyTorch (default accuracy sqnr>=35, on the held-out half and across the shape range) and the
# ones that pass timed side by side; the fastest is written as an artifact that names its engine.
# Prints the winner and the candidates table.
#   SIZE=small (default) | tiny | base     STEPS=100     BATCH=32  SEQ=128 (tiny: 8 and 16)
#   ACCURACY=sqnr>=35     BUDGET=20 (minutes before no new candidate starts)     OUT=runs/pipeline
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
SIZE=${SIZE:-small}
STEPS=${STEPS:-100}
OUT=${OUT:-runs/pipeline}
if [ "$SIZE" = tiny ]; then BATCH=${BATCH:-8}; SEQ=${SEQ:-16}; else BATCH=${BATCH:-32}; SEQ=${SEQ:-128}; fi
ACCURACY=${ACCURACY:-sqnr>=35}
BUDGET=${BUDGET:-20}
TK=".venv/bin/python -m tk"
mkdir -p "$OUT"
$TK train transformer --size "$SIZE" --steps "$STEPS" --out "$OUT/transformer-$SIZE.safetensors" \
  --samples "$OUT/transformer-$SIZE-samples.npz"
$TK optimize transformer --size "$SIZE" --checkpoint "$OUT/transformer-$SIZE.safetensors" \
  --data "$OUT/transformer-$SIZE-samples.npz" \
  --accuracy "$ACCURACY" --batch "$BATCH" --seq "$SEQ" --time-budget "$BUDGET" --out "$OUT/transformer-$SIZE"
$TK inspect "$OUT/transformer-$SIZE"
