#!/usr/bin/env bash
# A stalled rank must not hang the job: two ranks under mpirun, the last one stops itself after a
# step; the other must report the timeout and mpirun must end within timeout + 10 s of the stall.
# Usage: stall_test.sh <fault_stall binary> <mpiexec>. Kills every rank it started on exit.
set -u
BIN=$1
MPIEXEC=${2:-mpirun}
TIMEOUT_S=3
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardopt-stall.XXXXXX")
cleanup() {
  for f in "$WORK"/rank*.pid; do
    [ -s "$f" ] || continue
    pid=$(cat "$f")
    kill -CONT "$pid" 2>/dev/null
    kill -KILL "$pid" 2>/dev/null
  done
  rm -rf "$WORK"
}
trap cleanup EXIT
timeout -s KILL 90 "$MPIEXEC" --oversubscribe --allow-run-as-root --bind-to none -np 2 \
  "$BIN" "$TIMEOUT_S" "$WORK" >"$WORK/out" 2>&1
rc=$?
end=$(date +%s)
cat "$WORK/out"
fail() { echo "[stall_test] FAIL: $*" >&2; exit 1; }
[ -f "$WORK/stalled" ] || fail "the last rank never reached its stall"
elapsed=$((end - $(stat -c %Y "$WORK/stalled")))
echo "[stall_test] mpirun exited with $rc, ${elapsed} s after the stall (timeout ${TIMEOUT_S} s)"
[ "$rc" -ne 0 ] || fail "mpirun reported success"
[ "$rc" -ne 137 ] || fail "mpirun hung and was killed after 90 s"
grep -q "did not complete within $((TIMEOUT_S * 1000)) ms" "$WORK/out" ||
  fail "the timeout error is not in the output"
[ "$elapsed" -le $((TIMEOUT_S + 10)) ] || fail "the job took ${elapsed} s to end after the stall"
echo "[stall_test] PASS"
