#!/usr/bin/env bash
# A stalled rank must not hang the job: two ranks, the last one stops itself after a step; the
# other must report the timeout and end within timeout + 10 s of the stall.
#   stall_test.sh <fault_stall binary> <mpiexec>  under mpirun: mpirun itself must end
#   stall_test.sh <fault_stall binary> gloo       torchrun-style variables over Gloo, the process
#     group created with a 300 s timeout: rank 0 must end by the optimizer's 3 s (a launcher such
#     as torchrun then stops the others; here the script does)
# Kills every rank it started on exit.
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
if [ "$MPIEXEC" = gloo ]; then
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  export MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 SHARDOPT_BACKEND=gloo
  RANK=1 LOCAL_RANK=1 "$BIN" "$TIMEOUT_S" "$WORK" 300 >"$WORK/out1" 2>&1 &
  RANK=0 LOCAL_RANK=0 timeout -s KILL 90 "$BIN" "$TIMEOUT_S" "$WORK" 300 >"$WORK/out" 2>&1
  rc=$?
  end=$(date +%s)
  cat "$WORK/out1"
else
  timeout -s KILL 90 "$MPIEXEC" --oversubscribe --allow-run-as-root --bind-to none -np 2 \
    "$BIN" "$TIMEOUT_S" "$WORK" >"$WORK/out" 2>&1
  rc=$?
  end=$(date +%s)
fi
cat "$WORK/out"
fail() { echo "[stall_test] FAIL: $*" >&2; exit 1; }
[ -f "$WORK/stalled" ] || fail "the last rank never reached its stall"
elapsed=$((end - $(stat -c %Y "$WORK/stalled")))
echo "[stall_test] $MPIEXEC exited with $rc, ${elapsed} s after the stall (timeout ${TIMEOUT_S} s)"
[ "$rc" -ne 0 ] || fail "the job reported success"
[ "$rc" -ne 137 ] || fail "the job hung and was killed after 90 s"
grep -q "did not complete within $((TIMEOUT_S * 1000)) ms" "$WORK/out" ||
  fail "the timeout error is not in the output"
[ "$elapsed" -le $((TIMEOUT_S + 10)) ] || fail "the job took ${elapsed} s to end after the stall"
echo "[stall_test] PASS"
