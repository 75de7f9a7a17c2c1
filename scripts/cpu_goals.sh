#!/usr/bin/env bash
# Issue 22's goals for the small Transformer on this CPU in one run, ending with one summary table
# (stdout and summary.txt) and one JSON file (cpu_goals.json) in $OUT (default cpu_goals/):
#   train  tk train with held-out samples of the task (--samples), as scripts/pipeline.sh does
#   optimize  tk optimize on those samples at 32 x 128: the pick against eager float32, its held-out
#          SQNR, its wall time, and the int8 package against the bf16 one in the same rounds
#   bf16   scripts.bench_goals: the bf16 package against the bf16 rate at its own shapes (skipped, with the
#          reason, on a CPU without bf16 products)
# The goals name 2 cores: where this machine has more, every step is pinned to two physical cores of
# those it may use (CORES=0,2 chooses them, a comma-separated list; CORES=all pins nothing). The AMX
# goals need a CPU with AMX; the GPU machine's host has one (benchmarks/history.md). There, with
# torchao and the signing wheels carried
# (scripts/gpu_wheels.sh), from the repository root:
#   PYTHONPATH=/tmp/site:. PYTHON=python3 bash scripts/cpu_goals.sh
# Here: PYTHON=.venv/bin/python bash scripts/cpu_goals.sh. To test this script (2-3 minutes):
#   SIZE=tiny TRAIN_STEPS=5 BATCH=4 SEQ=16 SAMPLES=16 ITERS=2 PYTHON=.venv/bin/python bash scripts/cpu_goals.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-cpu_goals}
WORK=${WORK:-$(mktemp -d /tmp/tk-cpu-goals.XXXXXX)}
SIZE=${SIZE:-small}
TRAIN_STEPS=${TRAIN_STEPS:-100}
BATCH=${BATCH:-32}
SEQ=${SEQ:-128}
SAMPLES=${SAMPLES:-64}
ITERS=${ITERS:-16}
CORES=${CORES:-auto}
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)
STEPS="$WORK/steps.tsv"
: >"$STEPS"

two_physical_cores() {  # of the CPUs this process may use, the first of each of two physical cores, e.g. "0,1"
  local allowed
  allowed=$("$PY" -c 'import os; print(" ".join(map(str, sorted(os.sched_getaffinity(0)))))') || return
  lscpu -p=CPU,CORE,SOCKET 2>/dev/null | grep -v '^#' |
    awk -F, -v allowed="$allowed" 'BEGIN { n = split(allowed, a, " "); for (i = 1; i <= n; i++) ok[a[i]] = 1 }
      ($1 in ok) && !seen[$2 "," $3]++ { print $1 }' | head -n 2 | paste -sd, -
}
PIN=()
if [ "$CORES" = auto ]; then  # CORES: a comma-separated list of CPUs, or all
  CORES=all
  if [ "$(nproc)" -gt 2 ] && command -v taskset >/dev/null; then
    found=$(two_physical_cores)
    if [[ "$found" == *,* ]]; then CORES=$found; else echo "cpu_goals: found no two physical cores to pin to; not pinned" >&2; fi
  fi
fi
if [ "$CORES" != all ] && [ -n "$CORES" ]; then
  PIN=(taskset -c "$CORES")
  export OMP_NUM_THREADS=$(($(tr -cd , <<<"$CORES" | wc -c) + 1))
fi
echo "cores: $CORES" >"$WORK/cores.txt"

source scripts/step.sh  # step NAME LIMIT_S COMMAND...

CKPT="$WORK/$SIZE.safetensors"
step train 600 "$PY" -m tk train transformer --size "$SIZE" --steps "$TRAIN_STEPS" --out "$CKPT" \
  --samples "$WORK/$SIZE-val.npz" --samples-count "$SAMPLES"
# the optimize goal is 5 minutes: the limit leaves room to measure a run that misses it
step optimize 900 "$PY" -m tk optimize transformer --size "$SIZE" --checkpoint "$CKPT" --data "$WORK/$SIZE-val.npz" \
  --batch "$BATCH" --seq "$SEQ" --out "$WORK/optimize"
# a CPU without bf16 products would export and time an emulated package for a goal that names CPUs with them
# (the small Transformer's ran 2.4 s a call on the AVX2 EPYC: 100 s of this script for a 0.11x row)
NO_BF16=$("$PY" -c 'from tk.measure.hardware import cpu_precision_reason; print(cpu_precision_reason("bf16") or "")' \
  2>/dev/null | tail -n 1)
if [ -n "$NO_BF16" ]; then
  printf '%s\t%s\t%s\n' bf16 "skipped (no bf16)" 0 >>"$STEPS"
  echo "$NO_BF16" >"$WORK/bf16-skipped.txt"
  echo "== bf16 skipped: $NO_BF16" >&2
else
  step bf16 600 "$PY" -m scripts.bench_goals --int8-sizes '' --bf16-sizes "$SIZE" --skip-hf \
    --checkpoint "$SIZE=$CKPT" --batch "$BATCH" --seq "$SEQ" --iters "$ITERS" --out "$WORK/bf16"
fi

"$PY" scripts/cpu_goals_summary.py "$WORK" "$OUT" | tee "$OUT/summary.txt"
