#!/usr/bin/env bash
# Stage 3 with automatic units vs explicit units vs stage 2 on the example's BERT (issue 28's
# measurement), the three interleaved in every round; prints a markdown table per rank count of
# medians over the rounds: step time (median over the timed steps, slowest rank), communication
# elements per step (StepStats::comm_elements, the most of any rank, and as a multiple of the
# parameter count), model state after the step (opt.memory(), the most of any rank) and the peak of
# tracked tensor bytes during a step (the most of any rank). Each run is the session-end command of
# bench/log/2026-11-25-session-end-a45b314.md plus --stage/--units:
#   OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 mpirun -np 2 bert_pretrain --preset peer --synthetic
#     --steps 8 --batch-size 8 --max-seq-length 128 --threads 1 --timing-warmup 2
#
#   bench/auto_units.sh                          # peer model, 2 ranks, 3 rounds (~1.5 min quiet)
#   bench/auto_units.sh --model base --ranks 2,4 --rounds 1 --steps 4 --batch-size 2
#   bench/auto_units.sh --model peer --ranks 4 --rounds 3
# --model peer|base (or any --preset of bert_pretrain), --ranks a comma list, --steps includes
# --warmup untimed steps, --batch-size sequences per rank per step, --seq the sequence length.
# Step times are only comparable on a quiet machine (the table states the load average); the
# communication elements and the model state are deterministic. SHARDOPT_BUILD_DIR names the build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${SHARDOPT_BUILD_DIR:-$ROOT/build}"
PYTHON="${PYTHON:-/usr/bin/python3}"
TRAINER="$BUILD/examples/bert_pretrain"
ROUNDS=3 RANKS=2 PRESET=peer STEPS=8 WARMUP=2 BATCH=8 SEQ=128 OUT="${TMPDIR:-/tmp}/shardopt_auto_units.$$"
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS="$2"; shift 2 ;;
    --ranks) RANKS="$2"; shift 2 ;;
    --preset|--model) PRESET="$2"; shift 2 ;;
    --warmup) WARMUP="$2"; shift 2 ;;
    --batch-size) BATCH="$2"; shift 2 ;;
    --seq) SEQ="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "auto_units.sh: unknown option '$1' (--rounds N, --ranks N[,N...], --model peer|base, --steps N, --warmup N, --batch-size N, --seq N, --out DIR)" >&2; exit 2 ;;
  esac
done
if [ ! -x "$TRAINER" ]; then
  echo "[auto_units] $TRAINER is missing: build it (scripts/build.sh --target bert_pretrain)" >&2
  exit 2
fi
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
VARIANTS=("stage3_explicit:--stage 3 --units explicit" "stage3_auto:--stage 3 --units auto"
          "stage2:--stage 2")
START=$(date +%s)
IFS=',' read -r -a RANK_LIST <<<"$RANKS"
for np in "${RANK_LIST[@]}"; do
LOADS=()
for ((round = 1; round <= ROUNDS; ++round)); do
  for v in "${VARIANTS[@]}"; do
    name="${v%%:*}" flags="${v#*:}" dir="$OUT/np${np}_r${round}_${name}"
    LOADS+=("$(cut -d' ' -f1 /proc/loadavg)")
    echo "[auto_units] $PRESET, $np ranks, round $round/$ROUNDS: $name (load ${LOADS[-1]})" >&2
    # shellcheck disable=SC2086  # flags are words
    mpirun --oversubscribe --bind-to none -np "$np" "$TRAINER" --preset "$PRESET" --synthetic \
      --steps "$STEPS" --batch-size "$BATCH" --max-seq-length "$SEQ" --threads 1 \
      --timing-warmup "$WARMUP" --no-plot --progress lines --log-every 100 $flags --out "$dir" \
      >"$dir.log" 2>&1 || { cat "$dir.log" >&2; echo "[auto_units] $name failed (log above)" >&2; exit 1; }
  done
done
"$PYTHON" - "$OUT" "$ROUNDS" "$np" "$PRESET" "${LOADS[*]}" "$STEPS" "$WARMUP" "$BATCH" "$SEQ" <<'PY'
import json, os, statistics, subprocess, sys
out, rounds, ranks, preset, loads = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
steps, warmup, batch, seq = sys.argv[6:10]
names = ["stage3_explicit", "stage3_auto", "stage2"]
labels = {"stage3_explicit": "stage 3, explicit units", "stage3_auto": "stage 3, automatic units",
          "stage2": "stage 2"}
rows, psi = {}, None
for name in names:
    per = []
    for r in range(1, rounds + 1):
        s = json.load(open(os.path.join(out, f"np{ranks}_r{r}_{name}", "summary.json")))
        psi = s["parameters"]
        med = s["timing"]["per_rank_median"]
        per.append({"step": s["timing"]["median_step_s"],
                    "comm": max(m["comm_elements"] for m in med),
                    "state": max(s["last"]["memory_bytes"]),
                    "peak": max(m["step_peak_bytes"] for m in med)})
    rows[name] = {k: statistics.median(p[k] for p in per) for k in per[0]}
    rows[name]["steps"] = [p["step"] for p in per]
model = subprocess.run("lscpu | sed -n 's/^Model name: *//p'", shell=True, capture_output=True,
                       text=True).stdout.strip()
print(f"BERT preset {preset}, {ranks} ranks, {rounds} rounds interleaved, {steps} steps ({warmup} "
      f"untimed), {batch} sequences of {seq} per rank; {psi:,} parameters (Psi); CPU {model}; "
      f"load average (1 min) at the runs' starts: {loads}\n")
print("| | step s (median over rounds; each round: median of timed steps, slowest rank) | rounds | "
      "comm elements / step (max rank) | / Psi | model state after step (max rank) | peak tracked "
      "bytes in a step (max rank) |")
print("|---|---:|---|---:|---:|---:|---:|")
for name in names:
    r = rows[name]
    print(f"| {labels[name]} | {r['step']:.4f} | {' / '.join(f'{x:.3f}' for x in r['steps'])} | "
          f"{int(r['comm']):,} | {r['comm'] / psi:.4f} | {r['state'] / 2**20:.2f} MiB | "
          f"{r['peak'] / 2**20:.2f} MiB |")
a, e = rows["stage3_auto"], rows["stage3_explicit"]
print(f"\nautomatic vs explicit units: step time {a['step'] / e['step'] - 1:+.1%} (target within 10%), "
      f"comm elements {int(a['comm'] - e['comm']):+,} ({a['comm'] / e['comm'] - 1:+.3%}), model state "
      f"{a['state'] / e['state'] - 1:+.3%} (target within 1%), step peak {a['peak'] / e['peak'] - 1:+.1%}")
PY
echo
done
echo "[auto_units] runs and logs: $OUT; $(( $(date +%s) - START )) s in all" >&2
