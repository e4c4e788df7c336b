#!/usr/bin/env bash
# bert_pretrain and BERT's standard formats (issue 30), one CTest entry per MODE:
#   export  a Google-style bert_config.json for a tiny BERT trains on 2 ranks; the run writes
#           config.json; --export-hf writes config.json + model.safetensors + tokenizer files;
#           --eval-only --dump-logits on the export, and tests/python/check_hf_export.py (an
#           independent HF-structured PyTorch BERT, strict load) reproduces its logits <= 1e-5
#   init    --init-checkpoint from that export, from model.pt and from the checkpoint directory
#           gives the exporting run's final held-out MLM loss within 1e-4; a shape mismatch is
#           one line naming the key (exit 2); missing/unexpected keys are listed
#   lamb    --optimizer lamb (with --adam-eps, --adam-betas, --warmup-proportion, --lr-schedule
#           cosine) trains with a falling loss (--check-loss-decrease); so do --optimizer adafactor
#           and adamw8bit, whose checkpoint saved at 2 ranks resumes at 1
#   device  --device cuda where torch sees no GPU: exit 2 and one line on stderr (1 and 2 ranks)
# Usage: bert_formats_test.sh MODE BERT_PRETRAIN MPIEXEC CORPUS WORKDIR [PYTHON]
set -euo pipefail
MODE="$1" EXE="$2" MPIEXEC="$3" CORPUS="$4" WORK="$5" PY="${6:-/usr/bin/python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CHECKER="$HERE/../python/check_hf_export.py"
RUN="$WORK/run"  # the export mode's training run; the init mode reads it
mkdir -p "$WORK"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
mpi() { "$MPIEXEC" --oversubscribe --bind-to none -np "$@"; }
fail() { echo "FAIL: $*" >&2; exit 1; }
json() { "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {}, {'d': d}))" "$@"; }
COMMON=(--max-seq-length 64 --vocab-size 2000 --dupe-factor 2 --batch-size 8 --no-plot
        --progress lines --log-every 5 --threads 1)

case "$MODE" in
export)
  rm -rf "$RUN" && mkdir -p "$RUN"
  # Google's bert_config.json keys (no layer_norm_eps: BERT's 1e-12), plus one it does not use.
  cat >"$RUN/bert_config.json" <<'JSON'
{
  "attention_probs_dropout_prob": 0.1,
  "directionality": "bidi",
  "hidden_act": "gelu",
  "hidden_dropout_prob": 0.1,
  "hidden_size": 64,
  "initializer_range": 0.02,
  "intermediate_size": 256,
  "max_position_embeddings": 128,
  "num_attention_heads": 2,
  "num_hidden_layers": 2,
  "type_vocab_size": 2,
  "vocab_size": 2000
}
JSON
  mpi 2 "$EXE" "${COMMON[@]}" --bert-config "$RUN/bert_config.json" --steps 20 --warmup-steps 4 \
      --lr 2e-3 --corpus "$CORPUS" --eval-fraction 0.25 --save-model --export-hf "$RUN/hf" \
      --out "$RUN/out" >"$RUN/train.log" 2>&1 || { cat "$RUN/train.log"; fail "training"; }
  cat "$RUN/train.log"
  grep -q "keys that do not change the model, ignored: directionality" "$RUN/train.log" \
    || fail "the unused key is not reported"
  grep -q "global batch 16 = 8 rows/rank x 2 ranks" "$RUN/train.log" || fail "no global batch in the log"
  for f in out/config.json hf/config.json hf/model.safetensors hf/vocab.txt hf/tokenizer_config.json \
           hf/special_tokens_map.json out/model.pt; do
    [ -s "$RUN/$f" ] || fail "$f was not written"
  done
  [ "$(json "$RUN/hf/config.json" 'd["architectures"]')" = "['BertForPreTraining']" ] || fail "architectures"
  [ "$(json "$RUN/out/config.json" 'd["hidden_size"], d["layer_norm_eps"]')" = "(64, 1e-12)" ] \
    || fail "config.json does not describe the model"
  # The example's logits on the first eval batch, from the export (a second config file round trip).
  D="$(json "$RUN/out/summary.json" 'd["data"]')" E="$(json "$RUN/out/summary.json" 'd["eval_data"]')"
  V="$(json "$RUN/out/summary.json" 'd["vocab"]')"
  "$EXE" "${COMMON[@]}" --bert-config "$RUN/hf/config.json" --init-checkpoint "$RUN/hf" --eval-only \
      --data "$D" --eval-data "$E" --vocab "$V" --eval-batch-size 8 --dump-logits "$RUN/logits.safetensors" \
      --out "$RUN/eval_hf" || fail "--eval-only --dump-logits"
  "$PY" "$CHECKER" "$RUN/hf" "$RUN/logits.safetensors" --tol 1e-5 || fail "independent check"
  ;;
init)
  [ -f "$RUN/out/summary.json" ] || fail "needs the export mode's run ($RUN)"
  want="$(json "$RUN/out/summary.json" 'repr(d["eval"]["mlm_loss"])')"
  D="$(json "$RUN/out/summary.json" 'd["data"]')" E="$(json "$RUN/out/summary.json" 'd["eval_data"]')"
  V="$(json "$RUN/out/summary.json" 'd["vocab"]')"
  for from in hf/model.safetensors out/model.pt out/checkpoint; do
    out="$WORK/init_$(echo "$from" | tr '/.' '__')"
    mpi 2 "$EXE" "${COMMON[@]}" --bert-config "$RUN/out/config.json" --init-checkpoint "$RUN/$from" \
        --eval-only --data "$D" --eval-data "$E" --vocab "$V" --out "$out" >"$out.log" 2>&1 \
      || { cat "$out.log"; fail "--init-checkpoint $from"; }
    grep "init checkpoint" "$out.log"
    got="$(json "$out/eval.json" 'repr(d["mlm_loss"])')"
    "$PY" -c "import sys; a,b=float(sys.argv[1]),float(sys.argv[2]); print(f'$from: eval MLM loss {b} vs {a} of the exporting run'); sys.exit(abs(a-b) > 1e-4)" "$want" "$got" \
      || fail "$from: eval MLM loss $got, the exporting run's $want"
  done
  # A fine-tuned BERT has no NSP head: an MLM-only model from the full export lists what it skips.
  cfg="$WORK/mlm_only.json"
  "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); d['architectures']=['BertForMaskedLM']; json.dump(d, open(sys.argv[2],'w'))" \
      "$RUN/hf/config.json" "$cfg"
  "$EXE" "${COMMON[@]}" --bert-config "$cfg" --init-checkpoint "$RUN/hf/model.safetensors" --eval-only \
      --data "$D" --eval-data "$E" --vocab "$V" --out "$WORK/init_mlm" >"$WORK/init_mlm.log" 2>&1 \
    || { cat "$WORK/init_mlm.log"; fail "MLM-only init"; }
  grep -q "unexpected, not used (4): bert.pooler.dense.bias, bert.pooler.dense.weight, cls.seq_relationship.bias, cls.seq_relationship.weight" \
      "$WORK/init_mlm.log" || { cat "$WORK/init_mlm.log"; fail "unexpected keys not listed"; }
  # Another shape: one line naming the key, exit 2.
  "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); d['intermediate_size']=128; json.dump(d, open(sys.argv[2],'w'))" \
      "$RUN/hf/config.json" "$WORK/other_shape.json"
  set +e
  "$EXE" "${COMMON[@]}" --bert-config "$WORK/other_shape.json" --init-checkpoint "$RUN/hf" --eval-only \
      --data "$D" --eval-data "$E" --vocab "$V" --out "$WORK/init_bad" >"$WORK/bad.out" 2>"$WORK/bad.err"
  rc=$?
  set -e
  cat "$WORK/bad.err"
  [ "$rc" = 2 ] || fail "shape mismatch: exit $rc, expected 2"
  [ "$(wc -l <"$WORK/bad.err")" = 1 ] || fail "shape mismatch: not one line"
  grep -q "'bert.encoder.layer.0.intermediate.dense.weight' has shape \[256, 64\] in the checkpoint but \[128, 64\]" \
      "$WORK/bad.err" || fail "shape mismatch: the key is not named"
  ;;
lamb)
  rm -rf "$WORK/lamb"
  mpi 2 "$EXE" "${COMMON[@]}" --preset tiny --steps 30 --lr 5e-3 --optimizer lamb --adam-eps 1e-6 \
      --adam-betas 0.9,0.999 --warmup-proportion 0.1 --lr-schedule cosine --weight-decay 0.01 \
      --corpus "$CORPUS" --eval-fraction 0 --check-loss-decrease --out "$WORK/lamb" \
      >"$WORK/lamb.log" 2>&1 || { cat "$WORK/lamb.log"; fail "LAMB did not train (exit $?)"; }
  cat "$WORK/lamb.log"
  grep -q "lamb (betas 0.9, 0.999, eps 1e-06" "$WORK/lamb.log" || fail "the log does not name LAMB"
  grep -q "warm-up 3, then cosine" "$WORK/lamb.log" || fail "warm-up proportion / schedule"
  rm -rf "$WORK/adafactor"
  mpi 2 "$EXE" "${COMMON[@]}" --preset tiny --steps 30 --lr 1e-2 --optimizer adafactor \
      --warmup-steps 3 --weight-decay 0.01 --corpus "$CORPUS" --eval-fraction 0 \
      --check-loss-decrease --out "$WORK/adafactor" >"$WORK/adafactor.log" 2>&1 ||
      { cat "$WORK/adafactor.log"; fail "Adafactor did not train (exit $?)"; }
  cat "$WORK/adafactor.log"
  grep -q "adafactor (torch's beta2_decay -0.8" "$WORK/adafactor.log" ||
      fail "the log does not name Adafactor"
  # 8-bit AdamW trains, and its quantised state checkpoints: saved at 2 ranks, resumed at 1.
  rm -rf "$WORK/adamw8bit"
  mpi 2 "$EXE" "${COMMON[@]}" --preset tiny --steps 30 --lr 5e-3 --optimizer adamw8bit \
      --warmup-steps 3 --weight-decay 0.01 --corpus "$CORPUS" --eval-fraction 0 \
      --check-loss-decrease --out "$WORK/adamw8bit" >"$WORK/adamw8bit.log" 2>&1 ||
      { cat "$WORK/adamw8bit.log"; fail "8-bit AdamW did not train (exit $?)"; }
  cat "$WORK/adamw8bit.log"
  grep -q "adamw8bit (betas 0.9, 0.999" "$WORK/adamw8bit.log" || fail "the log does not name adamw8bit"
  rm -rf "$WORK/adamw8bit_ckpt"
  A8=("${COMMON[@]}" --preset tiny --steps 4 --optimizer adamw8bit --checkpoint-every 2
      --corpus "$CORPUS" --eval-fraction 0 --out "$WORK/adamw8bit_ckpt")
  mpi 2 "$EXE" "${A8[@]}" --stop-after 2 >"$WORK/adamw8bit_ckpt.log" 2>&1 ||
      { cat "$WORK/adamw8bit_ckpt.log"; fail "8-bit AdamW did not save a checkpoint (exit $?)"; }
  "$EXE" "${A8[@]}" --resume >"$WORK/adamw8bit_resume.log" 2>&1 ||
      { cat "$WORK/adamw8bit_resume.log"; fail "8-bit AdamW did not resume (exit $?)"; }
  grep -q "resumed from .* at step 2" "$WORK/adamw8bit_resume.log" ||
      { cat "$WORK/adamw8bit_resume.log"; fail "the resumed run does not start at step 2"; }
  ;;
device)
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    echo "a GPU is visible: --device cuda is exercised by scripts/gpu-check.sh instead"
    exit 0
  fi
  for np in 1 2; do
    set +e
    if [ "$np" = 1 ]; then
      "$EXE" --device cuda --preset tiny --synthetic --steps 1 --out "$WORK/cuda" >"$WORK/cuda.out" 2>"$WORK/cuda.err"
    else
      mpi 2 "$EXE" --device cuda --preset tiny --synthetic --steps 1 --out "$WORK/cuda" >"$WORK/cuda.out" 2>"$WORK/cuda.err"
    fi
    rc=$?
    set -e
    cat "$WORK/cuda.err"
    # One process: exit 2 and one line; under mpirun (which adds its own report) rank 0 alone speaks.
    if [ "$np" = 1 ]; then
      [ "$rc" = 2 ] || fail "--device cuda: exit $rc, expected 2"
      [ "$(grep -c . "$WORK/cuda.err")" = 1 ] || fail "--device cuda: not one line"
    else
      [ "$rc" != 0 ] || fail "--device cuda on 2 ranks: exit 0"
    fi
    [ "$(grep -c "^bert_pretrain: error: --device cuda: no CUDA device" "$WORK/cuda.err")" = 1 ] \
      || fail "--device cuda on $np rank(s): the message, once"
  done
  ;;
*) fail "unknown mode '$MODE'" ;;
esac
echo "bert_formats_test $MODE: 1 passed, 0 failed"
