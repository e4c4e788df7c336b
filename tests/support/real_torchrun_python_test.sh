#!/usr/bin/env bash
# PyTorch's own torchrun (pip's) launching the Python bindings: BERT-tiny (train_bert.py) trains 5
# steps at stage 2 over torch.distributed's Gloo group (shardopt.from_process_group()) and must
# reproduce the losses of the same run under mpirun (shardopt's MPI engine).
#   real_torchrun_python_test.sh local|hosts <torchrun> <python> <train_bert.py> <mpiexec>
#     local: 1 host x 2 ranks; hosts: 2 emulated hosts x 1 rank (exit 77 where none can be made)
# PYTHONPATH must reach the shardopt package (CTest sets it to <build>/python).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CASE=$1 TORCHRUN=$2 PY=$3 SCRIPT=$4 MPIEXEC=$5
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardopt-real-torchrun.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
fail() { echo "[real_torchrun] FAIL: $*" >&2; exit 1; }

if [ "$CASE" = hosts ]; then
  "$HERE/../multihost/emulated_hosts.sh" check || exit $?
fi
TRAIN=("$SCRIPT" --preset tiny --stage 2 --steps 5 --batch 4 --log-every 1)
timeout -s KILL 300 "$MPIEXEC" --allow-run-as-root --oversubscribe --bind-to none -np 2 \
  "$PY" "${TRAIN[@]}" --losses "$WORK/mpi.jsonl" >"$WORK/mpi.log" 2>&1 ||
  { cat "$WORK/mpi.log"; fail "mpirun run"; }
grep -q "(mpi)" "$WORK/mpi.log" || { cat "$WORK/mpi.log"; fail "the mpirun run did not use MPI"; }
# No MPI variables: torchrun's own (RANK, MASTER_ADDR, ..., TORCHELASTIC_USE_AGENT_STORE).
for v in $(env | grep -oE '^(OMPI_COMM_WORLD|PMI|PMIX|SLURM)[A-Z_]*' || true); do unset "$v"; done
case "$CASE" in
  local)
    port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    launch=(timeout -s KILL 300 "$TORCHRUN" --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1
            --master-port "$port" --max-restarts 0) ;;
  hosts)
    launch=(env SHARDOPT_TORCHRUN="$TORCHRUN" "$HERE/../multihost/emulated_hosts.sh" --hosts 2
            --per-host 1 --timeout 300 real-torchrun --) ;;
  *) fail "unknown case '$CASE'" ;;
esac
"${launch[@]}" "${TRAIN[@]}" --launcher torchrun --losses "$WORK/torchrun.jsonl" \
  >"$WORK/torchrun.log" 2>&1 || { cat "$WORK/torchrun.log"; fail "the run under torchrun"; }
cat "$WORK/torchrun.log"
grep -q "(gloo)" "$WORK/torchrun.log" || fail "the torchrun run did not use torch's Gloo group"

# Every step's loss, compared to 1e-5 relative (MPI and Gloo sum two ranks' values alike).
"$PY" - "$WORK/mpi.jsonl" "$WORK/torchrun.jsonl" <<'EOF' || fail "losses differ"
import json, sys
def losses(path):
    return {j["step"]: j["loss"] for j in map(json.loads, open(path))}
mpi, tr = losses(sys.argv[1]), losses(sys.argv[2])
print("[real_torchrun] step  mpirun  torchrun")
for s in sorted(mpi):
    print(f"[real_torchrun] {s}  {mpi[s]!r}  {tr.get(s)!r}")
assert len(mpi) == 5, f"mpirun logged {len(mpi)} steps, expected 5"
assert sorted(tr) == sorted(mpi), f"steps {sorted(tr)} != {sorted(mpi)}"
worst = max(abs(tr[s] - mpi[s]) / abs(mpi[s]) for s in mpi)
print(f"[real_torchrun] largest relative difference {worst:.3g}")
assert worst <= 1e-5, worst
EOF
echo "[real_torchrun] ok: python $CASE"
