#!/usr/bin/env bash
# Launches a command the way torchrun's agent does (static rendezvous, --max-restarts=0), without
# torchrun, whose Debian builds do not run (README, "torchrun on Debian"): node 0's agent serves a
# TCPStore on MASTER_PORT with the torch Python package (agent_store.py), every node's agent joins
# it before starting its workers, and each worker gets torchrun's variables, among them
# TORCHELASTIC_USE_AGENT_STORE=True: the workers connect to the agent's store as clients. The
# first failing worker ends the others and the launcher fails with its exit code; whatever the
# launcher started ends with it, however it ends (the store sees its stdin close).
#
#   torchrun_env.sh [--nnodes N] [--node-rank R] [--master-addr A] [--master-port P]
#                   [--run-id ID] [--rdzv-timeout S] NPROC_PER_NODE command args...
# One node by default, on 127.0.0.1 and a port the store picks (only one node may pick its own).
# SHARDOPT_TORCH_PYTHON: the Python with torch (/usr/bin/python3).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
nnodes=1 node_rank=0 addr=127.0.0.1 port=0 run_id=none rdzv_timeout=60
die() { echo "torchrun_env: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --nnodes) nnodes="$2"; shift 2 ;;
    --node-rank) node_rank="$2"; shift 2 ;;
    --master-addr) addr="$2"; shift 2 ;;
    --master-port) port="$2"; shift 2 ;;
    --run-id) run_id="$2"; shift 2 ;;
    --rdzv-timeout) rdzv_timeout="$2"; shift 2 ;;
    --*) die "unknown option '$1' (see the header of $0)" ;;
    *) break ;;
  esac
done
[ $# -ge 2 ] || die "usage: $0 [options] NPROC_PER_NODE command args..."
nproc="$1"
shift
[[ "$nproc" =~ ^[1-9][0-9]*$ ]] || die "NPROC_PER_NODE must be a positive integer, got '$nproc'"
[[ "$nnodes" =~ ^[1-9][0-9]*$ ]] && [[ "$node_rank" =~ ^[0-9]+$ ]] && ((node_rank < nnodes)) ||
  die "--node-rank must lie in [0, --nnodes), got $node_rank of $nnodes"
((nnodes == 1 || port != 0)) || die "--master-port is needed with --nnodes $nnodes"
for v in $(env | grep -oE '^(OMPI_COMM_WORLD|PMI|PMIX|SLURM)[A-Z_]*' || true); do unset "$v"; done

pids=()
cleanup() {  # the workers' process groups, then the store, which ends when its stdin closes
  local p
  trap - EXIT INT TERM
  for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null; done
  if [ -n "${STORE_PID:-}" ]; then
    eval "exec ${STORE[1]}>&-"
    wait "$STORE_PID" 2>/dev/null
  fi
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

coproc STORE {
  exec "${SHARDOPT_TORCH_PYTHON:-/usr/bin/python3}" "$HERE/agent_store.py" --addr "$addr" \
    --port "$port" --nnodes "$nnodes" --node-rank "$node_rank" --timeout "$rdzv_timeout"
}
store_pid=$STORE_PID
ready="" port_read=""
read -r ready port_read <&"${STORE[0]}"
[ "$ready" = ready ] ||
  { echo "[torchrun_env] the agent's store at $addr:$port did not come up (see above)" >&2; exit 1; }
port=$port_read
world=$((nnodes * nproc))
echo "[torchrun_env] node $node_rank of $nnodes, $nproc processes, agent store at $addr:$port: $*"
declare -A rank_of
for ((l = 0; l < nproc; l++)); do
  r=$((node_rank * nproc + l))
  # The variables torchrun's LocalElasticAgent gives each worker (torch 1.13 and 2.x); each
  # worker leads its own process group, which is ended as a whole, as torch 2's agent does.
  LOCAL_RANK=$l RANK=$r GROUP_RANK=$node_rank ROLE_RANK=$r ROLE_NAME=default \
    LOCAL_WORLD_SIZE=$nproc WORLD_SIZE=$world GROUP_WORLD_SIZE=$nnodes ROLE_WORLD_SIZE=$world \
    MASTER_ADDR=$addr MASTER_PORT=$port TORCHELASTIC_RESTART_COUNT=0 \
    TORCHELASTIC_MAX_RESTARTS=0 TORCHELASTIC_RUN_ID=$run_id TORCHELASTIC_USE_AGENT_STORE=True \
    NCCL_ASYNC_ERROR_HANDLING=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1 \
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} \
    setsid "$@" > >(sed -u "s/^/[rank $r] /") 2>&1 &
  pids+=($!)
  rank_of[$!]=$r
done

running=("${pids[@]}")
while ((${#running[@]} > 0)); do
  done_pid=""
  wait -n -p done_pid "${running[@]}" "$store_pid"
  status=$?
  if [ "$done_pid" = "$store_pid" ]; then
    echo "[torchrun_env] the agent's store exited (status $status); ending the workers" >&2
    exit 1
  fi
  left=()
  for p in "${running[@]}"; do [ "$p" = "$done_pid" ] || left+=("$p"); done
  running=("${left[@]}")
  if [ "$status" -ne 0 ]; then
    echo "[torchrun_env] rank ${rank_of[$done_pid]} failed (exit $status); ending the others" >&2
    exit "$status"
  fi
done
exit 0
