#!/usr/bin/env bash
# Per-rank memory of ZeRO stages 0-3 at N = 1, 2, 4, 8 ranks for BERT-base and BERT-large shapes,
# measured (memory tracker + memory()) vs docs/stages.md's formula; markdown table, verdict, PNG.
# Needs the project built (scripts/test.sh, or scripts/build.sh --target memory_scaling).
#
#   bench/memory_scaling.sh                                  # all, 12 GiB budget per run
#   bench/memory_scaling.sh --models base --ranks 1,2,4 --budget-gib 8 --png bench/results/x.png
#   bench/memory_scaling.sh --models large --ranks 8 --stages 2,3 --cap-mb auto --budget-gib 20
#       # per-rank cap on tensor storage (the tracker refuses past it): stage 3 runs, stage 2 is
#       # refused; 'auto' = halfway between stage 3's peak bound and stage 2's model state
#
# Options are those of bench/memory_scaling.py (--help). SHARDOPT_BUILD_DIR names the build dir.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${SHARDOPT_BUILD_DIR:-$ROOT/build}"
BINARY="$BUILD/bench/memory_scaling"
if [ ! -x "$BINARY" ]; then
  echo "[memory] $BINARY is missing: building it (scripts/build.sh --target memory_scaling)" >&2
  SHARDOPT_BUILD_DIR="$BUILD" "$ROOT/scripts/build.sh" --target memory_scaling
fi
exec /usr/bin/python3 "$ROOT/bench/memory_scaling.py" --binary "$BINARY" "$@"
