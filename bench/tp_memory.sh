#!/usr/bin/env bash
# Per-rank memory of bert_pretrain --tp at (t, d) = (1,4), (2,2), (4,1), with and without
# --sequence-parallel, against the formula (bench/tp_memory.py --help). Needs bert_pretrain built.
#   bench/tp_memory.sh [--preset base] [--stage 3] [--batch-size 8] [--seq 128] [--steps 3]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${SHARDOPT_BUILD_DIR:-$ROOT/build}"
BINARY="$BUILD/examples/bert_pretrain"
if [ ! -x "$BINARY" ]; then
  echo "[tp-memory] $BINARY is missing: building it" >&2
  SHARDOPT_BUILD_DIR="$BUILD" "$ROOT/scripts/build.sh" --target bert_pretrain
fi
exec /usr/bin/python3 "$ROOT/bench/tp_memory.py" --binary "$BINARY" "$@"
