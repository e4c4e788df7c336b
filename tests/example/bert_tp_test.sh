#!/usr/bin/env bash
# bert_pretrain with tensor parallelism (issue 40; Note [Tensor-parallel BERT] in
# examples/bert/model.hpp). A small BERT of 4 heads, vocabulary 1000 (padded to 1024 at --tp 2
# and 4, so the last ranks hold padding rows), dropout 0, lr 2e-3, 20 steps.
#   golden: the per-step losses of (t, d) = (2, 1), (2, 2) and (4, 1) at stages 0, 1, 2 and 3
#           equal those of the (1, d) run on the same (synthetic) data within 1e-4; sequence
#           parallelism at stages 1 and 3, automatic stage-3 units at (2, 2). Bad layouts are
#           refused with one line naming the flag (exit 2).
#   clip:   real data (tests/assets/corpus). The global gradient norm (clipping, --max-grad-norm
#           1) at (2, 2) equals that of (1, 1) with --grad-accum 2 (the same 8 rows a step): within
#           1e-6 relative at step 1, where both start from the same weights, and within 1e-5 over
#           10 steps (the trajectories then differ by fp32 rounding: ~1e-6 by step 5). A run at
#           (2, 2) stopped at step 5 and resumed from its checkpoints (one per tensor rank)
#           continues with the uninterrupted run's losses, and so do runs resumed from it at
#           (4, 1) stage 3 and (1, 2) stage 1 (within 1e-4; checkpoints across layouts,
#           shardopt/grid_checkpoint.hpp); resuming at another --tp into the same folder is refused.
#           Its Hugging Face export is the unsplit model (the vocabulary's padding rows dropped), and
#           so is its --save-model model.pt (both tensor ranks' folders put together), equal to
#           the export bitwise and to the (1, 1) run's model.pt within 1e-4.
#           With dropout 0.1 at (2, 1), a run resumed at step 5 repeats the uninterrupted losses
#           bitwise (the checkpoint keeps each tensor rank's dropout stream).
# Usage: bert_tp_test.sh golden|clip BERT_PRETRAIN MPIEXEC WORKDIR [CORPUS] [PYTHON]
set -euo pipefail
MODE="$1" EXE="$2" MPIEXEC="$3" WORK="$4" CORPUS="${5:-}" PY="${6:-/usr/bin/python3}"
rm -rf "$WORK" && mkdir -p "$WORK"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
fail() { echo "FAIL: $*" >&2; exit 1; }
cat >"$WORK/config.json" <<'EOF'
{"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
 "intermediate_size": 256, "hidden_act": "gelu", "max_position_embeddings": 64,
 "type_vocab_size": 2, "initializer_range": 0.02, "hidden_dropout_prob": 0.1,
 "attention_probs_dropout_prob": 0.1}
EOF
CONFIG="$WORK/config.json"
COMMON=(--dropout 0 --lr 2e-3 --warmup-steps 2 --batch-size 4
        --max-seq-length 32 --threads 1 --no-plot --progress lines --log-every 5)
train() {  # RANKS NAME FLAGS...
  local n="$1" name="$2"; shift 2
  "$MPIEXEC" --oversubscribe --bind-to none -np "$n" "$EXE" --bert-config "$CONFIG" "${COMMON[@]}" "$@" --out "$WORK/$name" \
    >"$WORK/$name.log" 2>&1 || { local rc=$?; cat "$WORK/$name.log"; fail "$name: exit $rc"; }
  grep -E "training:|golden" "$WORK/$name.log" || true
}
refused() {  # RANKS NAME EXPECTED-TEXT FLAGS...
  local n="$1" name="$2" text="$3"; shift 3
  set +e
  "$MPIEXEC" --oversubscribe --bind-to none -np "$n" "$EXE" --bert-config "$CONFIG" "${COMMON[@]}" "$@" --out "${OUT:-$WORK/$name}" \
    >"$WORK/$name.log" 2>&1
  local rc=$?
  set -e
  grep "error:" "$WORK/$name.log" || true
  [ "$rc" -eq 2 ] || { cat "$WORK/$name.log"; fail "$name: exit $rc, expected 2"; }
  grep -q -- "$text" "$WORK/$name.log" || fail "$name: the error does not say '$text'"
}

if [ "$MODE" = golden ]; then
  S=(--synthetic --steps 20)
  train 1 d1 "${S[@]}" --stage 0 --write-golden "$WORK/d1.txt"
  train 2 d2 "${S[@]}" --stage 0 --write-golden "$WORK/d2.txt"
  for stage in 0 1 2 3; do
    extra=()
    [ $((stage % 2)) -eq 1 ] && extra=(--sequence-parallel)
    train 2 "t2d1_s$stage" "${S[@]}" --stage $stage --tp 2 "${extra[@]}" --golden "$WORK/d1.txt" --golden-tol 1e-4
    units=()
    [ "$stage" -eq 3 ] && units=(--units auto)
    train 4 "t2d2_s$stage" "${S[@]}" --stage $stage --tp 2 "${extra[@]}" "${units[@]}" --golden "$WORK/d2.txt" --golden-tol 1e-4
    train 4 "t4d1_s$stage" "${S[@]}" --stage $stage --tp 4 "${extra[@]}" --golden "$WORK/d1.txt" --golden-tol 1e-4
  done
  grep -q "tp=2 x dp=2 x pp=1 with sequence parallelism" "$WORK/t2d2_s1.log" || fail "the plan does not state the layout"
  refused 2 bad_world "does not divide\|differs\|tp=3" "${S[@]}" --steps 1 --tp 3
  sed 's/"num_attention_heads": 4/"num_attention_heads": 2/' "$WORK/config.json" >"$WORK/heads2.json"
  CONFIG="$WORK/heads2.json" refused 4 bad_heads "num_attention_heads 2 is not divisible by the tensor-parallel size 4" "${S[@]}" --steps 1 --tp 4
  refused 1 bad_sp "--sequence-parallel: needs --tp 2" "${S[@]}" --steps 1 --sequence-parallel
  echo "golden: 12 tensor-parallel runs within 1e-4 of their (1, d) runs"
  exit 0
fi

[ "$MODE" = clip ] || fail "mode must be golden or clip, got $MODE"
sed -i 's/"vocab_size": 1000/"vocab_size": 2000/' "$WORK/config.json"
D=(--corpus "$CORPUS" --vocab-size 2000 --dupe-factor 2 --eval-fraction 0.1 --max-seq-length 64
   --steps 10 --stage 2 --max-grad-norm 1)
train 1 d1_accum2 "${D[@]}" --grad-accum 2 --save-model
train 4 t2d2 "${D[@]}" --tp 2 --save-model
# --save-model at --tp 2: model.pt from both tensor ranks' folders, unsplit; OUT/hf streamed.
"$PY" "$(dirname "${BASH_SOURCE[0]}")/../python/compare_model_outputs.py" "$WORK/d1_accum2" \
    "$WORK/t2d2" --tol 1e-4 || fail "--save-model / --export-hf at --tp 2 differ from (1, 1)'s"
# The export, unsplit, loads at --tp 1 and 4 (--init-checkpoint splits it) and evaluates as the
# (2, 2) run did at its last step.
cache=("$WORK"/t2d2/cache/pretrain-*.eval.bin)
for t in 1 4; do
  train $t "eval_tp$t" --eval-only --data "${cache[0]%.eval.bin}.bin" --eval-data "${cache[0]}" \
    --vocab "$WORK/t2d2/hf/vocab.txt" --bert-config "$WORK/t2d2/hf/config.json" \
    --init-checkpoint "$WORK/t2d2/hf" --tp $t
done
train 4 t2d2_part "${D[@]}" --tp 2 --stop-after 5
# Across layouts from its step-5 checkpoint: (4, 1) at stage 3 with 2 micro-batches (the same 8
# rows a step) and (1, 2) at stage 1; each into its own folder.
train 4 t4d1_from_t2d2 "${D[@]}" --tp 4 --stage 3 --grad-accum 2 --resume "$WORK/t2d2_part/checkpoint"
train 2 t1d2_from_t2d2 "${D[@]}" --stage 1 --resume "$WORK/t2d2_part/checkpoint"
OUT="$WORK/t2d2_part" refused 4 same_folder "was written at --tp 2" "${D[@]}" --tp 4 --resume
train 4 t2d2_part "${D[@]}" --tp 2 --resume
ls -d "$WORK"/t2d2_part/checkpoint/save-*/pp0-of-1/tp{0,1}-of-2 >/dev/null ||
  fail "no checkpoint per tensor rank"
"$PY" - "$WORK" <<'PY' || fail "tensor parallelism changed the gradient norm, the resume or the export"
import json, struct, sys
work = sys.argv[1]
def metrics(name):
    return [json.loads(l) for l in open(f"{work}/{name}/metrics.jsonl")]
ref, tp, resumed = metrics("d1_accum2"), metrics("t2d2"), metrics("t2d2_part")
assert len(ref) == len(tp) == len(resumed) == 10, (len(ref), len(tp), len(resumed))
rel = [abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] for a, b in zip(ref, tp)]
print("grad norm (1,1) accum 2:", [round(a["grad_norm"], 9) for a in ref])
print("grad norm (2,2):        ", [round(b["grad_norm"], 9) for b in tp])
print(f"relative difference: step 1 {rel[0]:.2e} (tolerance 1e-6), largest {max(rel):.2e} (1e-5)")
assert rel[0] <= 1e-6 and max(rel) <= 1e-5
loss = max(abs(a["loss"] - b["loss"]) for a, b in zip(ref, tp))
print(f"largest |loss (2,2) - loss (1,1) accum 2| = {loss:.2e} (tolerance 1e-4)")
assert loss <= 1e-4
gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(tp, resumed))
print(f"resumed at step 5: largest |loss - uninterrupted| = {gap:.2e} (tolerance 1e-6)")
assert gap <= 1e-6
for name in ("t4d1_from_t2d2", "t1d2_from_t2d2"):
    other = {m["step"]: m["loss"] for m in metrics(name)}
    assert sorted(other) == list(range(6, 11)), (name, sorted(other))
    gap = max(abs(m["loss"] - other[m["step"]]) for m in tp if m["step"] > 5)
    print(f"{name}: steps 6-10, largest |loss - uninterrupted (2,2)| = {gap:.2e} (tolerance 1e-4)")
    assert gap <= 1e-4
last = tp[-1]["eval"]
for t in (1, 4):
    e = json.load(open(f"{work}/eval_tp{t}/eval.json"))
    print(f"eval of the export at --tp {t}: MLM loss {e['mlm_loss']:.9f} acc {e['mlm_acc']:.4f}; "
          f"the (2,2) run at step 10: {last['mlm_loss']:.9f} acc {last['mlm_acc']:.4f}")
    assert abs(e["mlm_loss"] - last["mlm_loss"]) <= 1e-5 and e["mlm_acc"] == last["mlm_acc"]
    assert abs(e["nsp_loss"] - last["nsp_loss"]) <= 1e-5
# The export: safetensors header of the unsplit model, vocabulary 2000 (padding dropped).
with open(f"{work}/t2d2/hf/model.safetensors", "rb") as f:
    header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
shape = header["bert.embeddings.word_embeddings.weight"]["shape"]
print("exported word embeddings:", shape, "decoder bias:", header["cls.predictions.bias"]["shape"])
assert shape == [2000, 64] and header["cls.predictions.bias"]["shape"] == [2000]
assert header["bert.encoder.layer.0.attention.self.query.weight"]["shape"] == [64, 64]
assert header["bert.encoder.layer.0.output.dense.weight"]["shape"] == [64, 256]
PY
# With dropout, a resume at the same layout draws the split regions' masks of the uninterrupted
# run: the checkpoint keeps each tensor rank's dropout stream (tp::RngTracker::state). Bitwise.
R=(--corpus "$CORPUS" --vocab-size 2000 --dupe-factor 2 --steps 10 --stage 1 --dropout 0.1 --tp 2
   --checkpoint-every 5)
train 2 dropout_full "${R[@]}"
train 2 dropout_part "${R[@]}" --stop-after 5
train 2 dropout_part "${R[@]}" --resume
"$PY" - "$WORK" <<'PY' || fail "a resume under --tp with dropout did not continue the same masks"
import json, sys
loss = lambda name: [json.loads(l)["loss"] for l in open(f"{sys.argv[1]}/{name}/metrics.jsonl")]
full, resumed = loss("dropout_full"), loss("dropout_part")
assert len(full) == len(resumed) == 10, (len(full), len(resumed))
print(f"dropout 0.1 at --tp 2, resumed at step 5: largest |loss - uninterrupted| = "
      f"{max(abs(a - b) for a, b in zip(full, resumed)):.2e} (expected 0)")
assert full == resumed
PY
echo "clip: gradient norm, resume (dropout streams too) and export at (2, 2) as at (1, 1)"
