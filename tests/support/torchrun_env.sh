#!/usr/bin/env bash
# Launches N copies of a command the way torchrun does, without torchrun: RANK, LOCAL_RANK,
# WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT set per process, no MPI variables. Fails
# when any process fails; the first failure ends the others, so a broken rank never leaves its
# peers waiting for the whole CTest timeout. Usage: torchrun_env.sh N command args...
set -uo pipefail
n="$1"
shift
# A free port from the kernel (bound and released; rank 0's TCPStore takes it right away).
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
for v in $(env | grep -oE '^(OMPI_COMM_WORLD|PMI|PMIX|SLURM)[A-Z_]*' || true); do unset "$v"; done
pids=()
for ((r = 0; r < n; r++)); do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=$n LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$@" > >(sed "s/^/[rank $r] /") 2>&1 &
  pids+=($!)
done
echo "[torchrun_env] $n processes, MASTER_ADDR=127.0.0.1 MASTER_PORT=$port: $*"
rc=0
finished=()
while ((${#finished[@]} < n)); do
  for ((r = 0; r < n; r++)); do
    [[ " ${finished[*]} " != *" $r "* ]] || continue
    kill -0 "${pids[r]}" 2>/dev/null && continue
    wait "${pids[r]}"
    status=$?
    finished+=("$r")
    if [ "$status" -ne 0 ] && [ "$rc" -eq 0 ]; then
      rc=$status
      echo "[torchrun_env] rank $r failed (exit $status); ending the others" >&2
      for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    fi
  done
  sleep 0.5
done
exit "$rc"
