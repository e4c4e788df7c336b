#!/usr/bin/env bash
# Issue 55 (a): asynchronous saves on BERT-base, 2 ranks, stage 2, fp32, 1 thread per rank
# (bench/async_checkpoint_bench.cpp), under mpirun and under Gloo (torchrun-style variables), the
# writer at its default priority and at +19; the machine and its load first.
#   scripts/build.sh --target async_checkpoint_bench && bench/async_checkpoint.sh [DIR] [ARGS...]
# DIR (default /tmp/async_checkpoint_bench) is the filesystem measured; ARGS go to the bench.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${SHARDOPT_BUILD_DIR:-$ROOT/build}/bench/async_checkpoint_bench"
DIR="${1:-/tmp/async_checkpoint_bench}"
shift || true
ARGS=(--preset base --stage 2 --threads 1 --dir "$DIR" "$@")
echo "# $(lscpu | grep 'Model name' | sed 's/  */ /g'); $(nproc) cores; $(uptime)"
echo "# filesystem: $(df -hT "$(dirname "$DIR")" | tail -1)"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for nice in 0 19; do
  echo "## mpirun -np 2 $BIN ${ARGS[*]} --writer-niceness $nice"
  mpirun --oversubscribe --allow-run-as-root -np 2 "$BIN" "${ARGS[@]}" --writer-niceness "$nice"
  echo "## gloo: RANK=0,1 WORLD_SIZE=2 SHARDOPT_BACKEND=gloo $BIN ${ARGS[*]} --writer-niceness $nice"
  for r in 0 1; do
    RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29700 + nice)) SHARDOPT_BACKEND=gloo \
      "$BIN" "${ARGS[@]}" --writer-niceness "$nice" > "$DIR.gloo$r.log" 2>&1 &
  done
  wait
  cat "$DIR.gloo0.log"
  echo "# $(uptime)"
done
