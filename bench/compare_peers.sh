#!/usr/bin/env bash
# shardopt's BERT trainer vs the PyTorch peer (DDP + AdamW, DDP + ZeroRedundancyOptimizer) on this
# machine, same model, data, batch, threads and steps; prints a markdown table. Needs the project
# built (scripts/test.sh or scripts/build.sh --target bert_pretrain) and /usr/bin/python3 with torch.
#
#   bench/compare_peers.sh                           # stages 0 1 2 3, 20 timed steps after 5
#   bench/compare_peers.sh --stages 0,2 --steps 10 --rounds 2 --variants all
#   PEER=/path/to/torch_zero_bert.py PYTHON=/usr/bin/python3 bench/compare_peers.sh
#
# Options are those of bench/compare_peers.py (--help). SHARDOPT_BUILD_DIR names the build dir.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${SHARDOPT_BUILD_DIR:-$ROOT/build}"
PYTHON="${PYTHON:-/usr/bin/python3}"
PEER="${PEER:-$ROOT/../shared/peers/torch_zero_bert.py}"
TRAINER="$BUILD/examples/bert_pretrain"
if [ ! -x "$TRAINER" ]; then
  echo "[compare] $TRAINER is missing: building it (scripts/build.sh --target bert_pretrain)" >&2
  SHARDOPT_BUILD_DIR="$BUILD" "$ROOT/scripts/build.sh" --target bert_pretrain
fi
exec "$PYTHON" "$ROOT/bench/compare_peers.py" --trainer "$TRAINER" --peer "$PEER" \
  --python "$PYTHON" "$@"
