#!/usr/bin/env bash
# bert_pretrain with pipeline parallelism (issue 41; Note [Pipelined BERT] in
# examples/bert/pipeline_stages.hpp). A small BERT of 8 encoder layers (so that p = 4 x v = 2
# stages each hold one), vocabulary 1000, dropout 0, lr 2e-3, 20 steps of synthetic data.
#   The per-step losses of (t, p, d) = (1, 2, 2), (2, 2, 1) and (1, 4, 1), every schedule (gpipe,
#   1f1b, interleaved at v = 2, zb-h1), ZeRO stages 0-3 (3: the model's declared units at
#   (1, 2, 2), automatic units at the others), --micro-batches 4,
#   equal those of the (1, 1, d) run with --grad-accum 4 on the same data within 1e-4 (--golden),
#   and their gradient norms within 1e-6 relative; (2, 2, 1) with sequence parallelism at stages 1
#   and 3.
#   At stages 1 and 3 with --save-model: model.pt (consolidated from the grid checkpoint) and the
#   streamed Hugging Face export have the (1, 1, 1) run's keys and unsplit shapes, equal each other
#   bitwise and the (1, 1, 1) run's model.pt within 1e-4 (tests/python/compare_model_outputs.py).
#   Bad combinations are refused with one line naming the flag (exit 2). 1f1b also runs stage 2
#   with --recompute (the same losses, a lower peak of tensor memory on every rank) and with
#   --shard-group-size 1 (hybrid sharding of each stage's data-parallel ranks).
#   resume: checkpoints across layouts (shardopt/grid_checkpoint.hpp), on real data (CORPUS):
#   a run at (2, 2, 1) stage 1 stopped at step 10 resumes at (1, 1, 4) stage 3 and at (1, 4, 1)
#   stage 0, and runs stopped there resume at (2, 2, 1) stage 1; each continues with the
#   uninterrupted (2, 2, 1) run's losses within 1e-4 (the same rows a step, in the same groups of
#   4). In its own folder it continues within 1e-6. Another layout into the same folder, and a
#   checkpoint with a stage folder of another save (not the one its commit.json names), are
#   refused; a rank killed before the commit of step 10 (its folder written) leaves step 5's.
#   Evaluation through the stages: --eval-only of the (2, 2, 1) run's export at (1, 1, 1),
#   (2, 2, 1) with sequence parallelism and (1, 4, 1) interleaved stage 3: held-out losses within
#   1e-5.
# Usage: bert_pp_test.sh reference|gpipe|1f1b|interleaved|zb-h1|resume BERT_PRETRAIN MPIEXEC WORKDIR [CORPUS [PYTHON]]
#   reference: the (1, 1, d) runs' golden files in WORKDIR, and the refusals; a schedule: its 12
#   runs against them (in WORKDIR/SCHEDULE).
set -euo pipefail
MODE="$1" EXE="$2" MPIEXEC="$3" BASE="$4" CORPUS="${5:-}" PY="${6:-/usr/bin/python3}"
WORK="$BASE/$MODE"
rm -rf "$WORK" && mkdir -p "$WORK"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
fail() { echo "FAIL: $*" >&2; exit 1; }
cat >"$WORK/config.json" <<'JSON'
{"vocab_size": 1000, "hidden_size": 32, "num_hidden_layers": 8, "num_attention_heads": 4,
 "intermediate_size": 64, "hidden_act": "gelu", "max_position_embeddings": 64,
 "type_vocab_size": 2, "initializer_range": 0.02, "hidden_dropout_prob": 0.1,
 "attention_probs_dropout_prob": 0.1}
JSON
COMMON=(--bert-config "$WORK/config.json" --dropout 0 --lr 2e-3 --warmup-steps 2 --batch-size 4
        --max-seq-length 32 --threads 1 --no-plot --progress lines --log-every 10 --synthetic --steps 20)
train() {  # RANKS NAME FLAGS...
  local n="$1" name="$2"; shift 2
  "$MPIEXEC" --oversubscribe --bind-to none -np "$n" "$EXE" "${COMMON[@]}" "$@" --out "$WORK/$name" \
    >"$WORK/$name.log" 2>&1 || { local rc=$?; cat "$WORK/$name.log"; fail "$name: exit $rc"; }
  grep -E "golden" "$WORK/$name.log" | sed "s/^/$name: /" || true
}
refused() {  # RANKS NAME EXPECTED-TEXT FLAGS...
  local n="$1" name="$2" text="$3"; shift 3
  set +e
  "$MPIEXEC" --oversubscribe --bind-to none -np "$n" "$EXE" "${COMMON[@]}" "$@" --out "${OUT:-$WORK/$name}" \
    >"$WORK/$name.log" 2>&1
  local rc=$?
  set -e
  [ "$rc" -eq 2 ] || { cat "$WORK/$name.log"; fail "$name: exit $rc, expected 2"; }
  grep -q -- "$text" "$WORK/$name.log" || { cat "$WORK/$name.log"; fail "$name: the error does not say '$text'"; }
}

if [ "$MODE" = resume ]; then
  [ -d "$CORPUS" ] || fail "resume needs the corpus folder as its 5th argument"
  sed -i 's/"vocab_size": 1000/"vocab_size": 2000/' "$WORK/config.json"
  # Real data instead of --synthetic (whose rows depend on the rank count).
  real=()
  for f in "${COMMON[@]}"; do [ "$f" = --synthetic ] || real+=("$f"); done
  COMMON=("${real[@]}" --corpus "$CORPUS" --vocab-size 2000 --dupe-factor 2)
  T2P2=(--tp 2 --pp 2 --schedule 1f1b --micro-batches 4 --stage 1)
  D4=(--stage 3)                    # 4 rows on each of 4 data-parallel ranks = 4 micro-batches of 4
  P4=(--pp 4 --schedule zb-h1 --micro-batches 4 --stage 0)
  train 4 full "${T2P2[@]}" --export-hf "$WORK/full_hf"
  train 4 part "${T2P2[@]}" --stop-after 10
  ls -d "$WORK"/part/checkpoint/commit.json "$WORK"/part/checkpoint/save-*/pp{0,1}-of-2/tp{0,1}-of-2 >/dev/null ||
    fail "no commit and folder per (pipeline, tensor) rank"
  train 4 d4_from_part "${D4[@]}" --resume "$WORK/part/checkpoint"
  train 4 p4_from_part "${P4[@]}" --resume "$WORK/part/checkpoint"
  train 4 d4_part "${D4[@]}" --stop-after 10
  train 4 p4_part "${P4[@]}" --stop-after 10
  train 4 from_d4 "${T2P2[@]}" --resume "$WORK/d4_part/checkpoint"
  train 4 from_p4 "${T2P2[@]}" --resume "$WORK/p4_part/checkpoint"
  OUT="$WORK/part" refused 4 same_folder "was written at --tp 2 --pp 2" "${D4[@]}" --resume "$WORK/part/checkpoint"
  # A stage folder of another save (step 20's) in place of the committed one (step 10's).
  committed() { "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["path"])' "$1/commit.json"; }
  cp -r "$WORK/part/checkpoint" "$WORK/mixed" && rm -rf "$WORK/mixed/$(committed "$WORK/mixed")/pp1-of-2"
  cp -r "$WORK/full/checkpoint/$(committed "$WORK/full/checkpoint")/pp1-of-2" "$WORK/mixed/$(committed "$WORK/mixed")/"
  refused 4 mixed_steps "does not belong to the committed save save-000001 of step 10" "${D4[@]}" --resume "$WORK/mixed"
  # A rank killed once its folder of step 10 is written, before the commit: step 5's loads.
  set +e
  BERT_TEST_FAULT=3:10:kill-before-commit "$MPIEXEC" --oversubscribe --bind-to none -np 4 "$EXE" "${COMMON[@]}" \
    "${T2P2[@]}" --stop-after 10 --checkpoint-every 5 --keep-checkpoints 2 --out "$WORK/killed" >"$WORK/killed.log" 2>&1
  set -e
  "$PY" -c 'import json, sys; c = json.load(open(sys.argv[1])); assert c["step"] == 5 and c["kept"] == ["save-000001"], c' \
    "$WORK/killed/checkpoint/commit.json" || { cat "$WORK/killed.log"; fail "the kill before the commit did not leave step 5's"; }
  train 4 from_killed "${D4[@]}" --stop-after 1 --resume "$WORK/killed/checkpoint"
  grep -q "at step 5" "$WORK/from_killed.log" || fail "the resume after the kill is not from step 5"
  train 4 part "${T2P2[@]}" --resume
  grep -q "resumed from $WORK/part/checkpoint (written at --tp 2 --pp 2)" "$WORK/d4_from_part.log" ||
    fail "the resume does not name the layout it read"
  "$PY" - "$WORK" <<'PY' || fail "a resume across layouts left the uninterrupted run's losses"
import json, sys
work = sys.argv[1]
def losses(name):
    return {m["step"]: m["loss"] for m in map(json.loads, open(f"{work}/{name}/metrics.jsonl"))}
full = losses("full")
assert sorted(full) == list(range(1, 21)), sorted(full)
def gap(name, tol, steps=range(11, 21)):
    other = losses(name)
    assert all(s in other for s in steps), (name, sorted(other))
    g = max(abs(full[s] - other[s]) for s in steps)
    print(f"{name}: steps {steps[0]}-{steps[-1]}, largest |loss - uninterrupted (2,2,1)| = {g:.2e} (tolerance {tol:g})")
    assert g <= tol, (name, g)
gap("part", 1e-6)
for name in ("d4_from_part", "p4_from_part", "from_d4", "from_p4"):
    gap(name, 1e-4)
for name in ("d4_part", "p4_part"):  # the runs the last two resumed, against (2, 2, 1) up to step 10
    gap(name, 1e-4, range(1, 11))
PY
  # Evaluation through the pipeline stages (--eval-only; PipelineStages::forward_only): the
  # weights of full's export at (1, 1, 1), at (2, 2, 1) stage 1 with sequence parallelism and at
  # (1, 4, 1) interleaved (v = 2) stage 3 give the same held-out losses within 1e-5.
  E=(--eval-only --init-checkpoint "$WORK/full_hf" --eval-fraction 0.2 --eval-batch-size 4)
  train 1 eval_d1 "${E[@]}"
  train 4 eval_t2p2 "${E[@]}" --tp 2 --pp 2 --sequence-parallel --schedule 1f1b --micro-batches 4 --stage 1
  train 4 eval_p4v2 "${E[@]}" --pp 4 --schedule interleaved --virtual-stages 2 --micro-batches 4 --stage 3
  "$PY" - "$WORK" <<'PY' || fail "evaluation under --pp differs from the (1, 1, 1) run's"
import json, sys
ev = lambda name: json.load(open(f"{sys.argv[1]}/{name}/eval.json"))
ref = ev("eval_d1")
assert ref["instances"] > 0 and ref["masked"] > 0, ref
for name in ("eval_t2p2", "eval_p4v2"):
    e = ev(name)
    gap = max(abs(e[k] - ref[k]) for k in ("mlm_loss", "nsp_loss"))
    print(f"{name}: MLM loss {e['mlm_loss']:.9f} NSP loss {e['nsp_loss']:.9f} over {e['instances']} "
          f"instances; (1, 1, 1): {ref['mlm_loss']:.9f} {ref['nsp_loss']:.9f}; largest gap {gap:.2e} (1e-5)")
    assert e["instances"] == ref["instances"] and e["masked"] == ref["masked"], (e, ref)
    assert gap <= 1e-5, (name, gap)
PY
  echo "resume: (2,2,1) stage 1 <-> (1,1,4) stage 3 and (1,4,1) stage 0 within 1e-4; bad checkpoints refused; evaluation under --pp"
  exit 0
fi
if [ "$MODE" = reference ]; then
  train 1 d1 --stage 0 --grad-accum 4 --write-golden "$BASE/d1.txt" --save-model
  train 2 d2 --stage 0 --grad-accum 4 --write-golden "$BASE/d2.txt"
  refused 2 bad_layers "each stage needs at least one" --pp 2 --schedule interleaved --virtual-stages 8 --micro-batches 4
  refused 2 bad_dump "--dump-logits is not supported with pipeline parallelism" --pp 2 --eval-only --dump-logits "$WORK/logits.safetensors"
  refused 2 bad_v "--virtual-stages" --pp 2 --virtual-stages 2
  refused 1 bad_mb "--micro-batches: needs --pp" --micro-batches 2
  echo "reference: $BASE/d1.txt, $BASE/d2.txt; 4 bad combinations refused"
  exit 0
fi
schedule="$MODE"
[ -f "$BASE/d1.txt" ] && [ -f "$BASE/d2.txt" ] || fail "no golden files in $BASE: run the reference mode first"
v=(); [ "$schedule" = interleaved ] && v=(--virtual-stages 2)
for stage in 0 1 2 3; do
  # Stage 3: the model's declared units at (1, 2, 2) (zb-h1 too: its input pass is no backward
  # pass of the units, Note [Pipeline handshake]), automatic units at the other layouts.
  units=(); [ "$stage" -eq 3 ] && units=(--units auto)
  P=(--schedule "$schedule" "${v[@]}" --micro-batches 4 --stage "$stage" --golden-tol 1e-4)
  train 4 "p2d2_s$stage" --pp 2 "${P[@]}" --golden "$BASE/d2.txt"
  sp=(); [ $((stage % 2)) -eq 1 ] && sp=(--sequence-parallel)  # stages 1 and 3
  # --save-model (model.pt from the grid checkpoint, OUT/hf streamed): at stages 1 and 3.
  save=(); [ $((stage % 2)) -eq 1 ] && save=(--save-model)
  train 4 "t2p2_s$stage" --tp 2 --pp 2 "${P[@]}" "${units[@]}" "${sp[@]}" "${save[@]}" --golden "$BASE/d1.txt"
  train 4 "p4_s$stage" --pp 4 "${P[@]}" "${units[@]}" "${save[@]}" --golden "$BASE/d1.txt"
done
# model.pt (consolidated from every folder of the grid checkpoint) and the streamed Hugging Face
# export of (2, 2, 1) and (1, 4, 1): the (1, 1, 1) run's keys and shapes, the export equal to the
# run's own model.pt bitwise, within 1e-4 of the reference's model.pt.
"$PY" "$(dirname "${BASH_SOURCE[0]}")/../python/compare_model_outputs.py" "$BASE/reference/d1" \
    "$WORK/t2p2_s1" "$WORK/t2p2_s3" "$WORK/p4_s1" "$WORK/p4_s3" --tol 1e-4 \
  || fail "--save-model / --export-hf under --pp differ from the (1, 1, 1) run's"
# The gradient norm too (a uniform scale error in the gradients leaves AdamW's losses alone): each
# step's within 1e-6 relative of the (1, 1, d) run's (measured: at most 1.3e-7 over 20 steps).
"$PY" - "$BASE" "$schedule" <<'PY' || fail "a pipelined run's gradient norm is not its (1, 1, d) run's"
import json, sys
base, schedule = sys.argv[1], sys.argv[2]
def norms(path):
    return [json.loads(l)["grad_norm"] for l in open(f"{path}/metrics.jsonl")]
for name in [f"{g}_s{s}" for g in ("p2d2", "t2p2", "p4") for s in range(4)]:
    ref = norms(f"{base}/reference/{'d2' if name.startswith('p2d2') else 'd1'}")
    got = norms(f"{base}/{schedule}/{name}")
    assert len(got) == len(ref) == 20, (name, len(got), len(ref))
    rel = max(abs(a - b) / a for a, b in zip(ref, got))
    print(f"{schedule}/{name}: largest relative |grad norm - (1, 1, d)'s| = {rel:.2e} (tolerance 1e-6)")
    assert rel <= 1e-6, name
PY
if [ "$schedule" = 1f1b ]; then
  # Recomputation per stage (and hybrid sharding of a stage's data-parallel ranks): the same losses,
  # less activation memory on every rank than the same run keeping its activations.
  P=(--schedule 1f1b --micro-batches 4 --stage 2 --golden-tol 1e-4 --golden "$BASE/d2.txt")
  train 4 p2d2_s2_recompute --pp 2 "${P[@]}" --recompute
  train 4 p2d2_s2_hybrid --pp 2 "${P[@]}" --shard-group-size 1
  "$PY" - "$WORK" <<'PY' || fail "--recompute under pipelines does not save activation memory"
import json, sys
work = sys.argv[1]
peak = lambda name: json.load(open(f"{work}/{name}/summary.json"))["peak_tensor_bytes"]
kept, recomputed = peak("p2d2_s2"), peak("p2d2_s2_recompute")
print(f"peak tensor bytes per rank, 1f1b stage 2: {kept} kept, {recomputed} recomputed")
assert all(r < k for r, k in zip(recomputed, kept)), (kept, recomputed)
PY
  refused 2 bad_recompute "--recompute with --schedule zb-h1" --pp 2 --schedule zb-h1 --recompute
fi
grep -q "tp=2 x dp=1 x pp=2" "$WORK/t2p2_s0.log" || fail "the plan does not state the layout"
if [ "$schedule" != interleaved ]; then
  grep -q "stage 0: embeddings + layers 0-3; stage 1: layers 4-7 + heads" "$WORK/p2d2_s0.log" ||
    fail "the plan does not state the stages"
fi
echo "$schedule: 12 pipelined runs within 1e-4 (losses) and 1e-6 relative (gradient norms) of their (1, 1, d) runs"
