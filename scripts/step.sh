# Sourced by scripts/gpu_check.sh and scripts/cpu_goals.sh, which set WORK and STEPS (and may set PIN, an
# array put before each command, such as taskset; and SKIP, step names to leave out).
# step NAME LIMIT_S COMMAND...: run COMMAND with a time limit, its output in $WORK/NAME.log, and append
# its outcome (ok, timeout, failed (exit N), skipped (SKIP)) and seconds to $STEPS.
step() {
  local name=$1 limit=$2
  shift 2
  if [[ " ${SKIP:-} " == *" $name "* ]]; then
    printf '%s\t%s\t%s\n' "$name" "skipped (SKIP)" 0 >>"$STEPS"
    return
  fi
  echo "== $name (limit ${limit}s): $*" >&2
  local start=$SECONDS
  timeout --kill-after=5 "$limit" ${PIN[@]+"${PIN[@]}"} "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  local outcome=ok
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && outcome=timeout
  [ $rc -ne 0 ] && [ "$outcome" = ok ] && outcome="failed (exit $rc)"
  printf '%s\t%s\t%s\n' "$name" "$outcome" "$((SECONDS - start))" >>"$STEPS"
  tail -n 3 "$WORK/$name.log" >&2
}
