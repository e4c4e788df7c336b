#!/usr/bin/env bash
# Automatic restart of the Python example (train_bert.py --snapshot-every 1) with a rank killed:
# the launcher starts the job again, which restores its newest committed snapshot from host memory
# (shardopt.MemorySnapshots) and finishes; its per-step losses equal the failure-free run's
# (no snapshots, no fault) bitwise. 2 ranks over two emulated hosts (--snapshot-dir .../host-{host}
# --ranks-per-host 1: each rank's buddy copy on the other "host"), dropout on so that the restored
# generator matters, faults placed by BERT_TEST_FAULT (disarmed in the restarted job):
#   kill           rank 1 SIGKILLs itself before step 5
#   kill-snapshot  rank 0 SIGKILLs itself right after the snapshot of step 3 started (its buddy
#                  exchange and commit in flight)
#   restart_python_test.sh torchrun <torchrun> <python> <train_bert.py>
#     pip's torchrun --max-restarts 2 over torch.distributed's Gloo group (--launcher torchrun)
#   restart_python_test.sh mpirun <shardopt-run> <python> <train_bert.py> <mpiexec>
#     scripts/shardopt-run --max-restarts 2 -- mpirun -np 2 (shardopt's MPI engine)
# PYTHONPATH must reach the shardopt package (CTest sets it to <build>/python).
set -u
MODE=$1 LAUNCHER=$2 PY=$3 SCRIPT=$4 MPIEXEC=${5:-}
STEPS=8
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardopt-restart-python.XXXXXX")
SHM_ROOT=/dev/shm
[ -d "$SHM_ROOT" ] && [ -w "$SHM_ROOT" ] || SHM_ROOT="$WORK"
SHM=$(mktemp -d "$SHM_ROOT/shardopt-restart-python.XXXXXX")
cleanup() {  # every process of ours tagged with a run under $WORK, then the files
  local f pid
  for f in /proc/[0-9]*/environ; do
    if grep -qsz "^SHARDOPT_RESTART_TEST_RUN=$WORK/" "$f"; then
      pid=${f#/proc/}
      pid=${pid%/environ}
      kill -KILL "$pid" 2>/dev/null
    fi
  done
  rm -rf "$WORK" "$SHM"
}
trap cleanup EXIT
fail() { echo "[restart_python] FAIL: $*" >&2; exit 1; }
# No MPI variables under torchrun (init_from_env would take them); torchrun's own are set by it.
if [ "$MODE" = torchrun ]; then
  for v in $(env | grep -oE '^(OMPI_COMM_WORLD|PMI|PMIX|SLURM)[A-Z_]*' || true); do unset "$v"; done
fi

TRAIN=(--preset tiny --stage 2 --steps $STEPS --batch 4 --dropout 0.1 --log-every 1)
run() {  # run <case> <max restarts> [train args]: one job (with its restarts), in the foreground
  local name=$1 restarts=$2
  shift 2
  local launch
  case "$MODE" in
    torchrun)
      local port
      port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
      launch=("$LAUNCHER" --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1
              --master-port "$port" --max-restarts "$restarts" --monitor-interval 0.1
              "$SCRIPT" --launcher torchrun) ;;
    mpirun)
      launch=("$LAUNCHER" --max-restarts "$restarts" -- "$MPIEXEC" --allow-run-as-root
              --oversubscribe --bind-to none -np 2 -x BERT_TEST_FAULT -x SHARDOPT_RESTART
              -x SHARDOPT_FAILED_AT -x PYTHONPATH "$PY" "$SCRIPT") ;;
    *) fail "unknown mode '$MODE'" ;;
  esac
  SHARDOPT_RESTART_TEST_RUN="$WORK/$name" timeout -s KILL 240 "${launch[@]}" "${TRAIN[@]}" \
    --losses "$WORK/$name.jsonl" "$@" >"$WORK/$name.log" 2>&1
}

# The failure-free run: no snapshots, no fault.
run clean 0 || { cat "$WORK/clean.log"; fail "the failure-free run"; }

check() {  # check <case>: finished, restored from memory, the clean run's losses bitwise
  local name=$1
  grep -q "restored snapshot" "$WORK/$name.log" ||
    { cat "$WORK/$name.log"; fail "$name: the restart did not restore a snapshot"; }
  grep -E "^\[train_bert\] (restart|restored|recovered|snapshot)" "$WORK/$name.log" | sed "s/^/[$name] /"
  "$PY" - "$WORK/clean.jsonl" "$WORK/$name.jsonl" "$WORK/$name.log" "$STEPS" "$name" <<'EOF' ||
import json, re, sys
def losses(path):
    out = {}
    for line in open(path):
        j = json.loads(line)
        assert j["step"] not in out, f"{path}: step {j['step']} logged twice"
        out[j["step"]] = j["loss"]
    return out
clean, got, steps, name = losses(sys.argv[1]), losses(sys.argv[2]), int(sys.argv[4]), sys.argv[5]
log = open(sys.argv[3]).read()
restarts = re.findall(r"\[train_bert\] restart (\d+) of this job", log)
assert restarts == ["1"], f"restarts {restarts}: expected one, which finished"
restored = [int(m) for m in re.findall(r"restored snapshot \d+ \(step (\d+)\)", log)]
assert len(restored) == 1 and 1 <= restored[0] < steps, f"restored steps {restored}"
print(f"[{name}] step  failure-free  restarted")
for s in sorted(clean):
    print(f"[{name}] {s}  {clean[s]!r}  {got.get(s)!r}")
assert sorted(clean) == list(range(steps)), sorted(clean)
assert sorted(got) == sorted(clean), f"steps {sorted(got)}"
differ = [s for s in clean if clean[s].hex() != got[s].hex()]
assert not differ, f"losses differ at steps {differ}"
print(f"[{name}] all {steps} losses equal bitwise; restored at step {restored[0]}")
EOF
    { cat "$WORK/$name.log"; fail "$name: losses"; }
}

snaps() { echo --snapshot-every 1 --snapshot-dir "$SHM/$1/host-{host}" --ranks-per-host 1; }
BERT_TEST_FAULT=1:5:kill run kill 2 $(snaps kill) ||
  { cat "$WORK/kill.log"; fail "kill: the job did not finish"; }
check kill
BERT_TEST_FAULT=0:3:kill-in-snapshot run kill-snapshot 2 $(snaps kill-snapshot) ||
  { cat "$WORK/kill-snapshot.log"; fail "kill-snapshot: the job did not finish"; }
check kill-snapshot
# A finished job gives its memory back (MemorySnapshots.remove()).
left=$(find "$SHM" -type f | head -5)
[ -z "$left" ] || fail "snapshot files left after the finished jobs: $left"
echo "[restart_python] ok: $MODE"
