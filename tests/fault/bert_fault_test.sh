#!/usr/bin/env bash
# Fault injection on the BERT trainer (2 ranks, tiny preset), placed deterministically by the
# trainer's test switch BERT_TEST_FAULT (Note [Test faults], examples/bert/train.cpp), never by
# racing the clock:
#   stalled       rank 1 stops itself (SIGSTOP) before step 5: rank 0 must report the timeout and
#                 the job end within --timeout + 10 s;
#   killed_saving rank 1 SIGKILLs itself inside the save of step 6, after writing its shard: the
#                 step-4 checkpoint must survive, unharmed by the half-written one;
#   killed_committing  rank 1 SIGKILLs itself in the save of step 6 once its folder is complete,
#                 before the commit: step 4's commit must stay the one that loads;
#   raised        rank 1 raises an error before step 3, outside any collective, with a 120 s
#                 timeout: the job must end within 10 s with the message (shardopt::run_or_abort);
#   async_pp_between_folders  --pp 2 --async-checkpoints (two folders, pp0-of-2 and pp1-of-2, one
#                 commit): rank 1's background thread SIGKILLs the process once its folder of step
#                 6 is complete, before the commit, while rank 0's folder is written or complete:
#                 step 4's commit must stay the one that loads, never a mix of the two saves;
#   async_pp_saving  the same, both stages' background threads killed once their shard file is
#                 written, before their folder's manifest.
# Each time the last checkpoint must load, and resuming from it must reproduce the uninterrupted
# run's losses bitwise. Then a resume of the finished run must say there is nothing to train.
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
now() { date +%s.%N; }
secs() { python3 -c 'import sys; print(f"{float(sys.argv[2]) - float(sys.argv[1]):.1f}")' "$1" "$2"; }
within() { python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) <= float(sys.argv[2]) else 1)' "$1" "$2"; }

"$EXE" build-vocab --corpus "$CORPUS" --vocab-size 2000 -o "$WORK/vocab.txt" >/dev/null ||
  fail "build-vocab"
"$EXE" create-data --corpus "$CORPUS" --vocab "$WORK/vocab.txt" --max-seq-length 64 \
  --dupe-factor 2 -o "$WORK/data.bin" >/dev/null || fail "create-data"
train() {  # train <out dir> [extra args]: runs in the foreground (the last --timeout wins)
  local out=$1
  shift
  SHARDOPT_FAULT_RUN="$out" timeout -s KILL 300 "$MPIEXEC" --allow-run-as-root --oversubscribe \
    --bind-to none -np 2 -x BERT_TEST_FAULT \
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

export BERT_TEST_FAULT=
t0=$(now)
train "$WORK/whole" >"$WORK/whole.log" 2>&1 || { cat "$WORK/whole.log"; fail "the uninterrupted run"; }
WHOLE_S=$(secs "$t0" "$(now)")
echo "[bert_fault] uninterrupted run: $STEPS steps in ${WHOLE_S} s"

# faulty <name> <BERT_TEST_FAULT> <allowed s beyond the uninterrupted run> <message> <checkpoint
# step> [extra args]: runs with the fault, checks the job failed in time with the message and
# kept the checkpoint of that step, then resumes (with the same extra args) and compares every
# loss with those of the uninterrupted run $WORK/$REF (default: whole).
faulty() {
  local name=$1 fault=$2 slack=$3 message=$4 kept=$5 out=$WORK/$1
  shift 5
  local t0 rc elapsed
  t0=$(now)
  BERT_TEST_FAULT=$fault train "$out" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  elapsed=$(secs "$t0" "$(now)")
  cat "$WORK/$name.log"
  echo "[bert_fault] $name: BERT_TEST_FAULT=$fault; mpirun exited with $rc after ${elapsed} s" \
       "(uninterrupted run ${WHOLE_S} s, allowed + ${slack} s)"
  [ "$rc" -ne 0 ] || fail "$name: the job reported success"
  within "$elapsed" "$(python3 -c "print($WHOLE_S + $slack)")" ||
    fail "$name: the job took ${elapsed} s to end"
  grep -qF -- "$message" "$WORK/$name.log" || fail "$name: no '$message' in the output"
  [ -f "$out/checkpoint/commit.json" ] || fail "$name: no checkpoint survived"
  local step  # the committed save's (Note [One commit for a grid])
  step=$(python3 -c 'import json, os, sys
c = json.load(open(os.path.join(sys.argv[1], "commit.json")))
print(json.load(open(os.path.join(sys.argv[1], c["path"], c["folders"][0]["path"], "manifest.json")))["trainer"]["step"])' \
         "$out/checkpoint" 2>/dev/null)
  [ "$step" = "$kept" ] || fail "$name: the surviving checkpoint is at step '$step', expected $kept"
  BERT_TEST_FAULT= train "$out" "$@" --resume >"$WORK/$name.resume.log" 2>&1 ||
    { cat "$WORK/$name.resume.log"; fail "$name: resuming from the last checkpoint"; }
  grep "resumed from" "$WORK/$name.resume.log"
  diff <(losses "$WORK/${REF:-whole}") <(losses "$out") ||
    fail "$name: the resumed run's losses differ from the uninterrupted run's"
  echo "[bert_fault] $name: resumed and reproduced all $STEPS losses"
}
faulty stalled 1:5:stop $((TIMEOUT_S + 10)) "did not complete within $((TIMEOUT_S * 1000)) ms" 4
faulty killed_saving 1:6:kill-in-save $((TIMEOUT_S + 10)) "signal 9" 4  # OpenMPI 5 wraps its line before it
faulty killed_committing 1:6:kill-before-commit $((TIMEOUT_S + 10)) "signal 9" 4
faulty raised 1:3:throw 10 "test fault (BERT_TEST_FAULT): rank 1 fails before step 3" 2 --timeout 120
# Asynchronous saves over two pipeline folders (pipelines at stage 1, as bert_pp_test.sh).
PP_ASYNC=(--pp 2 --micro-batches 2 --stage 1 --async-checkpoints)
train "$WORK/whole_pp" "${PP_ASYNC[@]}" >"$WORK/whole_pp.log" 2>&1 ||
  { cat "$WORK/whole_pp.log"; fail "the uninterrupted run at --pp 2 --async-checkpoints"; }
grep -q "checkpoint: step 4 committed" "$WORK/whole_pp.log" || fail "no asynchronous commit reported"
REF=whole_pp faulty async_pp_between_folders 1:6:kill-before-commit $((TIMEOUT_S + 10)) "signal 9" 4 \
  "${PP_ASYNC[@]}"
# kill-in-save names the rank in its data-parallel group (SaveOptions::after_shard_written): rank 0
# of each stage, both processes here.
REF=whole_pp faulty async_pp_saving 0:6:kill-in-save $((TIMEOUT_S + 10)) "signal 9" 4 "${PP_ASYNC[@]}"

# A finished run resumed: nothing to train, exit 0 on every rank at once, the log unchanged.
before=$(losses "$WORK/whole")
t0=$(now)
train "$WORK/whole" --resume --timeout 120 >"$WORK/finished.log" 2>&1
rc=$?
elapsed=$(secs "$t0" "$(now)")
cat "$WORK/finished.log"
[ "$rc" -eq 0 ] || fail "resuming a finished run exited with $rc"
grep -q "is at step $STEPS of $STEPS: nothing to train; raise --steps to continue" "$WORK/finished.log" ||
  fail "resuming a finished run: no 'nothing to train' line"
! grep -q "json.exception" "$WORK/finished.log" || fail "resuming a finished run: raw library text"
within "$elapsed" 10 || fail "resuming a finished run took ${elapsed} s"
[ "$before" = "$(losses "$WORK/whole")" ] || fail "resuming a finished run changed metrics.jsonl"
echo "[bert_fault] finished: resuming a finished run exits 0 in ${elapsed} s"
echo "[bert_fault] PASS"
