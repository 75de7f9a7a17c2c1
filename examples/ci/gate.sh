#!/usr/bin/env bash
# A CI gate for one model: export it, check its accuracy against the recorded baseline, bench its
# speed against the recorded baseline, and leave JUnit files for the CI to show. docs/ci.md explains it.
#
#   RECORD=1 examples/ci/gate.sh     # once, on the CI's kind of machine: record the baselines
#   examples/ci/gate.sh              # every build: exit 1 on a regression, 2 on a usage error
#
# Settings (environment): MODEL, SIZE, FORMAT, PRECISION (what to export); ENGINES (what to check
# and bench; eager is always benched too, the speed-ups are over it); BASELINES (directory of
# accuracy.json and speed.json); OUT (artifact and JUnit files); BATCH_SIZES, ITERS (bench);
# MAX_SLOWDOWN (percent); TK (how to run tk, e.g. "python -m tk"); ANY_CPU=1 to accept a speed
# baseline from another CPU; ARTIFACT to gate an artifact already exported (no export step). Every step runs even when an earlier gate fails, so both JUnit files exist.
set -uo pipefail

MODEL=${MODEL:-mlp}
SIZE=${SIZE:-tiny}
FORMAT=${FORMAT:-onnx}
PRECISION=${PRECISION:-fp32}
ENGINES=${ENGINES:-$FORMAT}
BASELINES=${BASELINES:-ci/baselines}
OUT=${OUT:-ci-out}
BATCH_SIZES=${BATCH_SIZES:-1,8}
ITERS=${ITERS:-20}
MAX_SLOWDOWN=${MAX_SLOWDOWN:-10}
TK=${TK:-tk}
read -ra tk <<< "$TK"

mkdir -p "$OUT" "$BASELINES"
rm -f "$OUT/check.xml" "$OUT/bench.xml"  # a step that ends early must not leave an older run's file to upload
status=0
step() {  # run a step, remember the worst exit code, keep going
    echo "+ $*" >&2
    "$@"
    local rc=$?
    if (( rc > status )); then status=$rc; fi
    return 0
}

if [[ "${RECORD:-0}" != 1 ]]; then
    for name in accuracy speed; do
        if [[ ! -f "$BASELINES/$name.json" ]]; then
            echo "error: no $BASELINES/$name.json: record the baselines first (RECORD=1 $0)" >&2
            exit 2
        fi
    done
fi

# 1. export (and the export-time check against PyTorch), unless ARTIFACT names one already exported
if [[ -n "${ARTIFACT:-}" ]]; then
    artifact=$ARTIFACT
else
    artifact="$OUT/artifact"
    rm -rf "$artifact"
    "${tk[@]}" export "$MODEL" --size "$SIZE" --format "$FORMAT" --precision "$PRECISION" --out "$artifact" || exit $?
fi

if [[ "${RECORD:-0}" == 1 ]]; then
    # record: the accuracy figures and their inputs' recipe, and the speed-ups over eager on this CPU
    step "${tk[@]}" check "$artifact" --engine "$ENGINES" --save-baseline "$BASELINES/accuracy.json" \
        --junit "$OUT/check.xml"
    step "${tk[@]}" bench "$artifact" --engine "eager,$ENGINES" --no-baselines --batch-sizes "$BATCH_SIZES" \
        --iters "$ITERS" --save-baseline "$BASELINES/speed.json" --junit "$OUT/bench.xml"
    exit $status
fi

any_cpu=()
if [[ "${ANY_CPU:-0}" == 1 ]]; then any_cpu=(--any-cpu); fi

# 2. accuracy against the baseline (same seed and shapes as recorded); exit 1 if a figure fell
step "${tk[@]}" check "$artifact" --engine "$ENGINES" --baseline "$BASELINES/accuracy.json" --junit "$OUT/check.xml"
# 3. speed-ups over eager against the baseline (its batch sizes); a busy machine is reported, not judged
step "${tk[@]}" bench "$artifact" --engine "eager,$ENGINES" --no-baselines --iters "$ITERS" \
    --baseline "$BASELINES/speed.json" --max-slowdown "$MAX_SLOWDOWN" "${any_cpu[@]}" --junit "$OUT/bench.xml"
exit $status
