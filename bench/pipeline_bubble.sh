#!/usr/bin/env bash
# Pipeline bubbles (issue 41): every schedule at p = 2 and 4 ranks, m = 4 and 8 micro-batches,
# measured from run_pipeline()'s action timings vs the simulator vs the formula, and the first
# stage's activation peak (bench/pipeline_bubble.cpp, Note [Measured bubble]). Writes the console
# to bench/results/pipeline_bubble.txt (or $1), headed by the CPU model, the core count and the
# load, since 4 ranks on a 2-core machine share cores.
#
#   bench/pipeline_bubble.sh [output] [pipeline_bubble options, e.g. --rounds 7]
#
# Needs the project built (scripts/build.sh --target pipeline_bubble); SHARDOPT_BUILD_DIR names
# the build dir. ~1-2 minutes on 2 quiet cores.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${SHARDOPT_BUILD_DIR:-$ROOT/build}"
BINARY="$BUILD/bench/pipeline_bubble"
OUT="${1:-$ROOT/bench/results/pipeline_bubble.txt}"
[ $# -gt 0 ] && shift
if [ ! -x "$BINARY" ]; then
  echo "[pipeline] $BINARY is missing: building it (scripts/build.sh --target pipeline_bubble)" >&2
  SHARDOPT_BUILD_DIR="$BUILD" "$ROOT/scripts/build.sh" --target pipeline_bubble
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
mkdir -p "$(dirname "$OUT")"
{
  echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(git -C "$ROOT" rev-parse --short HEAD)"
  echo "# $(lscpu | grep -m1 'Model name' | sed 's/  */ /g'); $(getconf _NPROCESSORS_ONLN) online CPUs, $(lscpu | grep -m1 'Thread(s) per core' | sed 's/  */ /g')"
  echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  for p in 2 4; do
    echo "\$ mpirun -np $p --oversubscribe --bind-to none $BINARY --microbatches 4,8 $*"
    mpirun -np "$p" --oversubscribe --bind-to none "$BINARY" --microbatches 4,8 "$@"
  done
  echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
} 2>&1 | tee "$OUT"
