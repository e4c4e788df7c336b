#!/usr/bin/env bash
# Tensor-parallel step time on the example BERT (bench/tp_step.cpp): forward + backward at t = 1
# (one rank) and t = 2 (two ranks, 1 thread each), interleaved A B B A per round, then one run at
# t = 2 with --time-collectives for the share of the step spent in the tensor group's collectives.
# Prints each run's JSON line and the medians; needs mpirun and the build (it builds tp_step).
#   bench/tp_timing.sh [--preset base] [--batch 8] [--seq 128] [--steps 6] [--rounds 2]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${SHARDOPT_BUILD_DIR:-$ROOT/build}"
PRESET=base BATCH=8 SEQ=128 STEPS=6 ROUNDS=2
while [ $# -gt 0 ]; do
  case "$1" in
    --preset) PRESET="$2"; shift 2 ;;
    --batch) BATCH="$2"; shift 2 ;;
    --seq) SEQ="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    *) echo "usage: bench/tp_timing.sh [--preset P] [--batch B] [--seq S] [--steps N] [--rounds R]" >&2; exit 2 ;;
  esac
done
[ -x "$BUILD/bench/tp_step" ] || SHARDOPT_BUILD_DIR="$BUILD" "$ROOT/scripts/build.sh" --target tp_step
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
run() {  # RANKS [flags]
  local n="$1"; shift
  mpirun --oversubscribe --allow-run-as-root --bind-to none -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS \
    -np "$n" "$BUILD/bench/tp_step" --preset "$PRESET" --batch "$BATCH" --seq "$SEQ" --steps "$STEPS" "$@" |
    grep '^{'
}
echo "[tp-timing] $(lscpu | sed -n 's/^Model name: *//p'), load $(cut -d' ' -f1-3 /proc/loadavg)"
OUT="$(mktemp)"
for _ in $(seq "$ROUNDS"); do
  run 1 | tee -a "$OUT"; run 2 | tee -a "$OUT"; run 2 | tee -a "$OUT"; run 1 | tee -a "$OUT"
done
run 2 --time-collectives | tee -a "$OUT"
python3 - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def med(t, timed): return statistics.median(r["step_s"] for r in rows if r["t"] == t and r["timed_collectives"] == timed)
t1, t2 = med(1, False), med(2, False)
timed = [r for r in rows if r["timed_collectives"]]
share = statistics.median(r["collective_s"] / r["step_s"] for r in timed)
print(f"[tp-timing] {rows[0]['preset']}, batch {rows[0]['batch']} x seq {rows[0]['seq']}: "
      f"t=1 {t1:.3f} s, t=2 {t2:.3f} s per forward+backward (medians); speed-up {t1 / t2:.2f}x "
      f"(ideal 2); at t=2 the collectives take {share:.0%} of a step run with them synchronous "
      f"({statistics.median(r['step_s'] for r in timed):.3f} s)")
PY
rm -f "$OUT"
echo "[tp-timing] load after: $(cut -d' ' -f1-3 /proc/loadavg)"
