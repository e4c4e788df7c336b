#!/usr/bin/env bash
# Fault injection on the BERT trainer (2 ranks, tiny preset): rank 1 is stalled (SIGSTOP) in the
# middle of training, and in a second run killed (SIGKILL) while a checkpoint is being written.
# Each time the job must end within --timeout + 10 s, the last checkpoint must load, and resuming
# from it must reproduce the uninterrupted run's losses bitwise.
# Usage: bert_fault_test.sh <bert_pretrain> <mpiexec> <corpus dir>. Kills what it started on exit.
set -u
EXE=$1
MPIEXEC=$2
CORPUS=$3
TIMEOUT_S=5
STEPS=10
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardopt-bert-fault.XXXXXX")
cleanup() {  # every process of ours tagged with a run under $WORK (timeout, mpirun, ranks)
  local f pid
  for f in /proc/[0-9]*/environ; do
    if grep -qsz "^SHARDOPT_FAULT_RUN=$WORK/" "$f"; then
      pid=${f#/proc/}
      pid=${pid%/environ}
      kill -CONT "$pid" 2>/dev/null
      kill -KILL "$pid" 2>/dev/null
    fi
  done
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "[bert_fault] FAIL: $*" >&2; exit 1; }

"$EXE" build-vocab --corpus "$CORPUS" --vocab-size 2000 -o "$WORK/vocab.txt" >/dev/null ||
  fail "build-vocab"
"$EXE" create-data --corpus "$CORPUS" --vocab "$WORK/vocab.txt" --max-seq-length 64 \
  --dupe-factor 2 -o "$WORK/data.bin" >/dev/null || fail "create-data"
train() {  # train <out dir> [extra args]: runs in the foreground
  local out=$1
  shift
  timeout -s KILL 300 "$MPIEXEC" --allow-run-as-root --oversubscribe --bind-to none -np 2 \
    "$EXE" --preset tiny --stage 2 --steps $STEPS --warmup-steps 2 --lr 2e-3 --batch-size 4 \
    --max-seq-length 64 --vocab "$WORK/vocab.txt" --data "$WORK/data.bin" --no-plot \
    --progress lines --log-every 1 --checkpoint-every 2 --timeout $TIMEOUT_S --out "$out" "$@"
}
losses() {  # "step loss" per line, loss in full precision
  python3 -c 'import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    print(j["step"], repr(j["loss"]))' "$1/metrics.jsonl"
}
rank_pid() {  # rank_pid <run tag> <rank>: our process of that rank in the run tagged so
  local f
  for f in /proc/[0-9]*/environ; do
    if grep -qsxz "SHARDOPT_FAULT_RUN=$1" "$f" && grep -qsxz "OMPI_COMM_WORLD_RANK=$2" "$f"; then
      f=${f#/proc/}
      echo "${f%/environ}"
      return
    fi
  done
}

train "$WORK/whole" >"$WORK/whole.log" 2>&1 || { cat "$WORK/whole.log"; fail "the uninterrupted run"; }

# faulty <name> <signal> <path>...: starts a run, waits for each path to appear in turn, then sends
# the signal to rank 1; checks the job ends promptly, then resumes and compares losses.
faulty() {
  local name=$1 sig=$2 out=$WORK/$1
  (export SHARDOPT_FAULT_RUN="$out"; exec 1>"$WORK/$name.log" 2>&1; train "$out") &
  local run=$!
  local victim= deadline=$(( $(date +%s) + 120 ))
  while [ -z "$victim" ] && [ "$(date +%s)" -lt $deadline ] && kill -0 "$run" 2>/dev/null; do
    sleep 0.2
    victim=$(rank_pid "$out" 1)
  done
  [ -n "$victim" ] || { cat "$WORK/$name.log"; fail "$name: rank 1 never started"; }
  local path
  for path in "${@:3}"; do  # each trigger path in turn
    while [ ! -e "$out/$path" ] && [ "$(date +%s)" -lt $deadline ] && kill -0 "$run" 2>/dev/null; do
      sleep 0.01
    done
    [ -e "$out/$path" ] || { cat "$WORK/$name.log"; fail "$name: $path never appeared"; }
  done
  local hit=no
  [ -e "$out/.checkpoint.tmp" ] && hit=yes
  local survivor=$(rank_pid "$out" 0)
  kill "-$sig" "$victim"
  local t0=$(date +%s)
  while kill -0 "$run" 2>/dev/null && [ $(( $(date +%s) - t0 )) -le $((TIMEOUT_S + 30)) ]; do
    sleep 0.2
  done
  if kill -0 "$run" 2>/dev/null; then  # hung: show where rank 0 is, then fail (cleanup kills)
    cat "$WORK/$name.log"
    command -v gdb >/dev/null && [ -n "$survivor" ] &&
      gdb -batch -p "$survivor" -ex "thread apply all bt 25" 2>/dev/null | grep -E "^(#|Thread)"
    fail "$name: the job still runs $((TIMEOUT_S + 30)) s after SIG$sig to rank 1"
  fi
  wait "$run"
  local rc=$? elapsed=$(( $(date +%s) - t0 ))
  cat "$WORK/$name.log"
  echo "[bert_fault] $name: SIG$sig to rank 1 (save in progress: $hit); mpirun exited with $rc" \
       "${elapsed} s later (timeout ${TIMEOUT_S} s)"
  [ "$rc" -ne 0 ] || fail "$name: the job reported success"
  [ "$elapsed" -le $((TIMEOUT_S + 10)) ] || fail "$name: the job took ${elapsed} s to end"
  [ -f "$out/checkpoint/manifest.json" ] || fail "$name: no checkpoint survived"
  train "$out" --resume >"$WORK/$name.resume.log" 2>&1 ||
    { cat "$WORK/$name.resume.log"; fail "$name: resuming from the last checkpoint"; }
  grep "resumed from" "$WORK/$name.resume.log"
  diff <(losses "$WORK/whole") <(losses "$out") ||
    fail "$name: the resumed run's losses differ from the uninterrupted run's"
  echo "[bert_fault] $name: resumed and reproduced all $STEPS losses"
}
faulty stalled STOP checkpoint/manifest.json
faulty killed_saving KILL checkpoint/manifest.json .checkpoint.tmp  # a second save
echo "[bert_fault] PASS"
