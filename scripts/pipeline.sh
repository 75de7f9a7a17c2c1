#!/usr/bin/env bash
# The main job: set up, then train the Transformer briefly, export it to every format this machine
# supports, check each against PyTorch, benchmark them side by side, and print the tables.
#   SIZE=small (default) | tiny | base     STEPS=100     OUT=runs/pipeline
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
SIZE=${SIZE:-small}
STEPS=${STEPS:-100}
OUT=${OUT:-runs/pipeline}
TK=".venv/bin/python -m tk"
mkdir -p "$OUT"
$TK train transformer --size "$SIZE" --steps "$STEPS" --out "$OUT/transformer-$SIZE.safetensors"
$TK export transformer --size "$SIZE" --checkpoint "$OUT/transformer-$SIZE.safetensors" --format all --out "$OUT/transformer-$SIZE"
$TK inspect "$OUT/transformer-$SIZE"
$TK check "$OUT/transformer-$SIZE" --engine all --json "$OUT/check.json"
$TK bench "$OUT/transformer-$SIZE" --engine all --batch-sizes 1,8,32 --seconds 2 --json "$OUT/bench.json" --plot "$OUT/bench.png"
