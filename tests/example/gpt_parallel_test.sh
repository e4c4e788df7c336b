#!/usr/bin/env bash
# gpt_train (examples/gpt) under tensor and pipeline parallelism: a decoder of 8 layers, hidden 32,
# 4 heads, 32 bytes a row, dropout 0 (but in the resume), 5 steps of 4 micro-batches of 2 rows
# (Note [Rows by number] in examples/gpt/corpus.hpp: every layout with the same d reads the same
# rows).
#   Each (t, p, d) run's per-step losses must be within 1e-4 of the (1, 1, d) run's with
#   --grad-accum 4, and its reported gradient norm (the clipping norm) within 1e-6 relative
#   (--golden FILE --golden-tol 1e-4 --golden-norm-tol 1e-6; the reference writes FILE).
#   quick (CTest gpt_parallel): (1,1,1) with --grad-accum 8 against (1,1,2) (the same rows);
#     (2,1,1) at stages 0-3; (1,2,1), (2,2,1), (1,2,2), (1,4,1) x gpipe, 1f1b, interleaved (V = 2),
#     zb-h1, each pair at one stage so that every layout and every schedule meets every stage once
#     (a Latin square; 20 runs against a reference in all); (1,2,1) interleaved with 3 micro-batches
#     against --grad-accum 3 (m not a multiple of p); bad combinations refused with one line
#     naming them (exit 2); a (2,2,1) run with dropout 0.1 stopped after step 2 resumes from its
#     checkpoints with the uninterrupted run's losses and norms (within 1e-6; bitwise here); a
#     (2,2,1) checkpoint at step 2 continues at (1,4,1) and (1,1,4) with the reference's; building
#     the model at (2,2,1) peaks at most 1.1x the parameters a rank holds.
#   full: the whole product, (2,1,1) x stages 0-3 and the four pipelined layouts x the four
#     schedules x stages 0-3 (68 runs; 3.2 min of CPU, 12 min on the loaded 2-core machine), and
#     the rest of quick.
# Usage: gpt_parallel_test.sh quick|full GPT_TRAIN MPIEXEC WORKDIR CORPUS
set -euo pipefail
MODE="$1" EXE="$2" MPIEXEC="$3" WORK="$4" CORPUS="$5"
rm -rf "$WORK" && mkdir -p "$WORK"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
  OMPI_MCA_btl=${OMPI_MCA_btl:-self,vader}
fail() { echo "FAIL: $*" >&2; exit 1; }
COMMON=(--corpus "$CORPUS" --preset tiny --layers 8 --hidden 32 --heads 4 --max-seq-length 32
        --batch-size 2 --steps 5 --warmup-steps 2 --lr 2e-3 --dropout 0 --progress lines)
train() {  # RANKS NAME FLAGS...
  local n="$1" name="$2"; shift 2
  "$MPIEXEC" --oversubscribe --allow-run-as-root --bind-to none -np "$n" "$EXE" "${COMMON[@]}" "$@" \
    --out "$WORK/$name" >"$WORK/$name.log" 2>&1 || { local rc=$?; cat "$WORK/$name.log"; fail "$name: exit $rc"; }
  grep -E "golden" "$WORK/$name.log" | sed "s/^/$name: /" || true
}
refused() {  # RANKS NAME EXPECTED-TEXT FLAGS...
  local n="$1" name="$2" text="$3"; shift 3
  set +e
  "$MPIEXEC" --oversubscribe --allow-run-as-root --bind-to none -np "$n" "$EXE" "${COMMON[@]}" "$@" \
    --out "$WORK/$name" >"$WORK/$name.log" 2>&1
  local rc=$?
  set -e
  [ "$rc" -eq 2 ] || { cat "$WORK/$name.log"; fail "$name: exit $rc, expected 2"; }
  grep -q -- "$text" "$WORK/$name.log" || { cat "$WORK/$name.log"; fail "$name: the error does not say '$text'"; }
}

train 1 d1 --stage 0 --grad-accum 4 --write-golden "$WORK/d1.txt"
train 2 d2 --stage 0 --grad-accum 4 --write-golden "$WORK/d2.txt"
G=(--golden-tol 1e-4 --golden-norm-tol 1e-6)
# Rows by number: one rank accumulating 8 micro-batches trains on the (1,1,2) run's global batches.
train 1 d1_m8 --stage 0 --grad-accum 8 --golden "$WORK/d2.txt" "${G[@]}"
for stage in 0 1 2 3; do
  train 2 "t2_s$stage" --tp 2 --grad-accum 4 --stage "$stage" --golden "$WORK/d1.txt" "${G[@]}"
done
# Each pipelined layout: its name, ranks, flags and reference.
NAMES=(p2 t2p2 p2d2 p4) RANKS=(2 4 4 4) FLAGS=("--pp 2" "--tp 2 --pp 2" "--pp 2" "--pp 4") REFS=(d1 d1 d2 d1)
SCHEDULES=(gpipe 1f1b interleaved zb-h1)
for i in "${!NAMES[@]}"; do
  for j in "${!SCHEDULES[@]}"; do
    s="${SCHEDULES[$j]}"
    v=(); [ "$s" = interleaved ] && v=(--virtual-stages 2)
    stages=$(( (i + j) % 4 ))
    [ "$MODE" = full ] && stages="0 1 2 3"
    for stage in $stages; do
      # shellcheck disable=SC2086
      train "${RANKS[$i]}" "${NAMES[$i]}_${s}_s$stage" ${FLAGS[$i]} --schedule "$s" "${v[@]}" \
        --micro-batches 4 --stage "$stage" --golden "$WORK/${REFS[$i]}.txt" "${G[@]}"
    done
  done
done
# Interleaved with m not a multiple of p (Note [Micro-batch groups]: 3 micro-batches in one group
# of N = 3 at p = 2, Megatron-core's rule) against --grad-accum 3.
train 1 d1_m3 --stage 0 --grad-accum 3 --write-golden "$WORK/d1_m3.txt"
train 2 p2_interleaved_m3 --pp 2 --schedule interleaved --virtual-stages 2 --micro-batches 3 \
  --stage 1 --golden "$WORK/d1_m3.txt" "${G[@]}"
grep -q "tp=2 x dp=1 x pp=2" "$WORK/t2p2_1f1b_s2.log" || fail "the plan does not state the layout"
grep -q "stage 0: embeddings + layers 0-3; stage 1: layers 4-7 + head" "$WORK/p2_1f1b_s1.log" ||
  fail "the plan does not state the stages"
# Construction at a rank's share (Note [Drawing only the slice]): at (2,2,1) no rank's tensors
# exceed 1.1x the parameters it holds while it builds (drawing whole matrices: 1.12-1.25x here);
# that the split model equals the unsplit one at step 0 is the golden's step-1 loss.
ratio=$(sed -n 's/.*highest over ranks \([0-9.]*\)x.*/\1/p' "$WORK/t2p2_1f1b_s2.log")
awk -v r="$ratio" 'BEGIN { exit !(r != "" && r <= 1.1) }' ||
  fail "construction at (2,2,1): peak ${ratio:-?}x the parameters a rank holds (over 1.1x)"
echo "construction at (2,2,1): peak ${ratio}x the parameters a rank holds"

# Bad combinations: refused before any work, one line naming the option.
refused 1 bad_heads "4 attention heads are not divisible by the tensor-parallel size" --tp 3
refused 1 bad_layers "6 pipeline stages do not divide the model's 8 layers" --pp 3 --micro-batches 3 \
  --schedule interleaved --virtual-stages 2
refused 1 bad_v "--virtual-stages: V >= 2 goes with --schedule interleaved" --pp 2 --virtual-stages 2
refused 1 bad_m "--micro-batches 1 must be at least --pp 2" --pp 2 --micro-batches 1 \
  --schedule interleaved --virtual-stages 2

# Resume at the same layout, with dropout (both streams checkpointed: the default generator's and
# the tensor ranks' own): (2,2,1), 1F1B, stage 2, stopped after step 2, then continued, repeats
# the uninterrupted run's losses and norms.
R=(--tp 2 --pp 2 --schedule 1f1b --micro-batches 4 --stage 2 --dropout 0.1)
train 4 drop_full "${R[@]}" --write-golden "$WORK/drop.txt"
train 4 part "${R[@]}" --stop-after 2
[ -f "$WORK/part/checkpoint/commit.json" ] || fail "no commit record of the grid's checkpoint"
train 4 part "${R[@]}" --resume --golden "$WORK/drop.txt" --golden-tol 1e-6 --golden-norm-tol 1e-6
grep -q "resumed from $WORK/part/checkpoint at step 2" "$WORK/part.log" || fail "the resume does not say so"
grep -q "golden $WORK/drop.txt: 3 steps compared" "$WORK/part.log" || fail "the resume did not run steps 3-5"
# Across layouts through the library alone (shardopt/grid_checkpoint.hpp): the step-2 checkpoint of
# a (2,2,1) run continues at (1,4,1) ZB-H1 stage 0 and at (1,1,4) stage 3 (8 rows a step in each)
# with the reference's losses and norms.
train 4 part0 --tp 2 --pp 2 --schedule 1f1b --micro-batches 4 --stage 2 --stop-after 2
train 4 p4_from_part0 --pp 4 --schedule zb-h1 --micro-batches 4 --stage 0 \
  --resume "$WORK/part0/checkpoint" --golden "$WORK/d1.txt" "${G[@]}"
train 4 d4_from_part0 --stage 3 --resume "$WORK/part0/checkpoint" --golden "$WORK/d1.txt" "${G[@]}"
grep -q "(written at --tp 2 --pp 2 --virtual-stages 1) at step 2" "$WORK/p4_from_part0.log" ||
  fail "the resume does not name the layout it read"
grep -q "golden $WORK/d1.txt: 3 steps compared" "$WORK/d4_from_part0.log" || fail "no steps 3-5"
# The largest deviations over every run compared with a golden file.
runs=$(grep -l "golden .*: ok" "$WORK"/*.log | wc -l)
grep -h "steps compared" "$WORK"/*.log |
  sed -E 's/.*\|loss - golden\| ([^ ]+) .*golden ([^ ]+) at step.*/\1 \2/' |
  awk -v n="$runs" '{ if ($1 > l) l = $1; if ($2 > g) g = $2 }
    END { printf "%s: %d runs within tolerance; largest |loss - reference| %.2e, gradient norm %.2e relative\n", "'"$MODE"'", n, l, g }'
