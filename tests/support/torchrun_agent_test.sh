#!/usr/bin/env bash
# Launches through the stand-in for torchrun's agent (torchrun_env.sh: the launcher serves the
# TCPStore, the ranks connect to it as clients): BERT-tiny trains 5 steps at stage 2 and must
# reproduce the losses of the same run under mpirun.
#   torchrun_agent_test.sh local <bert_pretrain> <mpiexec> <corpus>   2 ranks on this host
#   torchrun_agent_test.sh hosts <bert_pretrain> <mpiexec> <corpus>   2 emulated hosts x 1 rank
#                                                                     (exit 77 where none can be made)
#   torchrun_agent_test.sh real-local|real-hosts <bert_pretrain> <mpiexec> <corpus>
#     the same two through PyTorch's own torchrun (SHARDOPT_TORCHRUN: pip's; `--no-python`)
#   torchrun_agent_test.sh rank-error <bert_pretrain> <mpiexec> <corpus>
#     rank 1 of 2 raises outside any collective (BERT_TEST_FAULT, Note [Test faults] in
#     examples/bert/train.cpp): the job fails with the message within 10 s, far below --timeout.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CASE=$1 EXE=$2 MPIEXEC=$3 CORPUS=$4
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardopt-torchrun-agent.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
fail() { echo "[torchrun_agent] FAIL: $*" >&2; exit 1; }

if [ "$CASE" = hosts ] || [ "$CASE" = real-hosts ]; then
  "$HERE/../multihost/emulated_hosts.sh" check || exit $?
fi
"$EXE" build-vocab --corpus "$CORPUS" --vocab-size 2000 -o "$WORK/vocab.txt" >/dev/null ||
  fail "build-vocab"
"$EXE" create-data --corpus "$CORPUS" --vocab "$WORK/vocab.txt" --max-seq-length 64 \
  --dupe-factor 2 -o "$WORK/data.bin" >/dev/null || fail "create-data"
TRAIN=("$EXE" --preset tiny --stage 2 --steps 5 --warmup-steps 2 --lr 2e-3 --batch-size 4
       --max-seq-length 64 --vocab "$WORK/vocab.txt" --data "$WORK/data.bin" --no-plot
       --progress lines --log-every 1 --timeout 60)

if [ "$CASE" = rank-error ]; then
  # Each line stamped as it arrives: the time from rank 1's error to the job's end is measured,
  # not the start-up, which a loaded machine may slow down at will.
  env -u SHARDOPT_BACKEND BERT_TEST_FAULT=1:3:throw "$HERE/torchrun_env.sh" 2 "${TRAIN[@]}" \
    --out "$WORK/agent" 2>&1 |
    while IFS= read -r line; do echo "$(date +%s%N) $line"; done >"$WORK/agent.log"
  rc=${PIPESTATUS[0]}
  end=$(date +%s%N)
  cut -d' ' -f2- "$WORK/agent.log"
  error_at=$(grep -m1 "rank 1 fails before step 3" "$WORK/agent.log" | cut -d' ' -f1)
  [ -n "$error_at" ] || fail "the job (exit $rc) did not report rank 1's error"
  elapsed_ms=$(((end - error_at) / 1000000))
  echo "[torchrun_agent] exit $rc, $elapsed_ms ms after rank 1's error (collective timeout 60 s)"
  [ "$rc" -ne 0 ] || fail "the job succeeded although rank 1 failed"
  [ "$elapsed_ms" -lt 10000 ] || fail "the job took $elapsed_ms ms to end after the error (limit 10 s)"
  echo "[torchrun_agent] ok: $CASE"
  exit 0
fi
timeout -s KILL 300 "$MPIEXEC" --allow-run-as-root --oversubscribe --bind-to none -np 2 \
  "${TRAIN[@]}" --out "$WORK/mpi" >"$WORK/mpi.log" 2>&1 || { cat "$WORK/mpi.log"; fail "mpirun run"; }
case "$CASE" in
  local) launch=("$HERE/torchrun_env.sh" 2) ;;
  hosts) launch=("$HERE/../multihost/emulated_hosts.sh" --hosts 2 --per-host 1 --timeout 300
                 torchrun --) ;;
  real-local)
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    launch=("$SHARDOPT_TORCHRUN" --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1
            --master-port "$port" --max-restarts 0 --no-python) ;;
  real-hosts) launch=("$HERE/../multihost/emulated_hosts.sh" --hosts 2 --per-host 1 --timeout 300
                      real-torchrun -- --no-python) ;;
  *) fail "unknown case '$CASE'" ;;
esac
# No MPI variables, no SHARDOPT_BACKEND: init_from_env() must pick Gloo from torchrun's variables.
env -u SHARDOPT_BACKEND "${launch[@]}" "${TRAIN[@]}" --out "$WORK/agent" >"$WORK/agent.log" 2>&1 ||
  { cat "$WORK/agent.log"; fail "the run under the agent-store launcher"; }
cat "$WORK/agent.log"
# The launcher held MASTER_PORT all along: a rank 0 that served its own store would have failed.
case "$CASE" in
  real-*) ;;  # torchrun's agent: the same, but it prints nothing about it
  *) grep -q "agent store at" "$WORK/agent.log" || fail "the launcher did not serve the store" ;;
esac

# Every step's loss, compared to 1e-5 relative (MPI and Gloo sum two ranks' values alike).
python3 - "$WORK/mpi/metrics.jsonl" "$WORK/agent/metrics.jsonl" <<'EOF' || fail "losses differ"
import json, sys
def losses(path):
    return {j["step"]: j["loss"] for j in map(json.loads, open(path))}
mpi, agent = losses(sys.argv[1]), losses(sys.argv[2])
print("[torchrun_agent] step  mpirun  agent-store")
for s in sorted(mpi):
    print(f"[torchrun_agent] {s}  {mpi[s]!r}  {agent.get(s)!r}")
assert len(mpi) == 5, f"mpirun logged {len(mpi)} steps, expected 5"
assert sorted(agent) == sorted(mpi), f"steps {sorted(agent)} != {sorted(mpi)}"
worst = max(abs(agent[s] - mpi[s]) / abs(mpi[s]) for s in mpi)
print(f"[torchrun_agent] largest relative difference {worst:.3g}")
assert worst <= 1e-5, worst
EOF
echo "[torchrun_agent] ok: $CASE"
