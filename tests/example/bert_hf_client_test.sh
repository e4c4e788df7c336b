#!/usr/bin/env bash
# Hugging Face transformers as a real client of bert_pretrain (issue 39), one CTest entry per MODE;
# the checks themselves are tests/python/hf_client_check.py (transformers, HF_HUB_OFFLINE=1):
#   export  a tiny BERT trains 10 steps with --export-hf; transformers' BertForPreTraining loads the
#           directory with no missing, unexpected or mismatched key, reproduces the trainer's MLM
#           and NSP logits (--eval-only --dump-logits) within 1e-5, and its BertTokenizer encodes
#           corpus lines and awkward ones (accents, CJK, punctuation, case) as `bert_pretrain
#           tokenize` does
#   import  a random BertForPreTraining of the `tiny` shape written by save_pretrained loads with
#           --init-checkpoint DIR --bert-config DIR/config.json with nothing missing; the trainer's
#           logits and eval MLM and NSP losses on one batch equal transformers' within 1e-5
# Usage: bert_hf_client_test.sh MODE BERT_PRETRAIN PYTHON CORPUS WORKDIR
set -euo pipefail
MODE="$1" EXE="$2" PY="$3" CORPUS="$4" WORK="$5"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CHECK="$HERE/../python/hf_client_check.py"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_HOME="$WORK/hf-home"  # nothing read from or written to the user's cache
fail() { echo "FAIL: $*" >&2; exit 1; }
json() { "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {}, {'d': d}))" "$@"; }
COMMON=(--max-seq-length 64 --vocab-size 2000 --dupe-factor 2 --no-plot --progress lines --threads 1)
rm -rf "$WORK/$MODE" && mkdir -p "$WORK/$MODE"
W="$WORK/$MODE"

case "$MODE" in
export)
  "$EXE" "${COMMON[@]}" --preset tiny --steps 10 --warmup-steps 2 --lr 2e-3 --batch-size 8 \
      --log-every 5 --corpus "$CORPUS" --eval-fraction 0.25 --export-hf "$W/hf" --out "$W/out" \
      >"$W/train.log" 2>&1 || { cat "$W/train.log"; fail "training"; }
  D="$(json "$W/out/summary.json" 'd["data"]')" E="$(json "$W/out/summary.json" 'd["eval_data"]')"
  V="$(json "$W/out/summary.json" 'd["vocab"]')"
  "$EXE" "${COMMON[@]}" --bert-config "$W/hf/config.json" --init-checkpoint "$W/hf" --eval-only \
      --data "$D" --eval-data "$E" --vocab "$V" --eval-batch-size 8 \
      --dump-logits "$W/logits.safetensors" --out "$W/eval" >"$W/eval.log" 2>&1 \
    || { cat "$W/eval.log"; fail "--eval-only --dump-logits"; }
  # Text for the tokenizers: the corpus's first lines, and lines that exercise BasicTokenizer.
  # (awk, not `cat | head`: head's early exit kills cat with SIGPIPE, which pipefail turns into a
  # silent exit of this script, in most runs.)
  { awk 'NR <= 300' "$CORPUS"/*
    printf '%s\n' "Héllo, WORLD! Ça va? naïve café — “quoted” (parens) [brackets] {braces}" \
      "CJK: 中文字符 and 日本語 mixed with English; tabs	and   spaces" \
      "Numbers 3.14159, 1,000,000 and e-mail foo@bar.example; URLs http://x.y/z?q=1&r=2" \
      "ALL CAPS LICENSE, Section 4(a)(ii): \"Derivative Works\" -- hyphen-ated words..." \
      "Ünïcödé ÀÉÎÕÜ ñ ß Ø Å œ ﬁ ligature, Straße" \
      "supercalifragilisticexpialidocious antidisestablishmentarianism" ""; } >"$W/text.txt"
  "$EXE" tokenize --vocab "$W/hf/vocab.txt" -i "$W/text.txt" >"$W/ids.txt" 2>"$W/tokenize.err" \
    || { cat "$W/tokenize.err"; fail "bert_pretrain tokenize"; }
  "$PY" "$CHECK" export "$W/hf" "$W/logits.safetensors" "$W/text.txt" "$W/ids.txt" --tol 1e-5 \
    || fail "transformers does not load or reproduce the export"
  ;;
import)
  "$EXE" build-vocab --corpus "$CORPUS" --vocab-size 2000 -o "$W/vocab.txt" >"$W/vocab.log" 2>&1 \
    || { cat "$W/vocab.log"; fail "build-vocab"; }
  "$EXE" create-data "${COMMON[@]}" --corpus "$CORPUS" --vocab "$W/vocab.txt" --eval-fraction 0.25 \
      --eval-max-instances 8 --eval-output "$W/eval.data" -o "$W/train.data" >"$W/data.log" 2>&1 \
    || { cat "$W/data.log"; fail "create-data"; }
  "$PY" "$CHECK" make "$W/hf" --vocab "$W/vocab.txt" || fail "save_pretrained"
  # One eval batch (8 instances, create-data's --eval-max-instances), the one --dump-logits writes:
  # eval.json's losses are that batch's.
  "$EXE" "${COMMON[@]}" --bert-config "$W/hf/config.json" --init-checkpoint "$W/hf" --eval-only \
      --data "$W/train.data" --eval-data "$W/eval.data" --vocab "$W/vocab.txt" \
      --eval-batch-size 8 --dump-logits "$W/logits.safetensors" \
      --out "$W/eval" >"$W/eval.log" 2>&1 || { cat "$W/eval.log"; fail "--init-checkpoint from save_pretrained"; }
  cat "$W/eval.log"
  grep -q "init checkpoint: .* parameters loaded" "$W/eval.log" || fail "no init checkpoint report"
  if grep -qE "init checkpoint: (missing|unexpected)" "$W/eval.log"; then
    fail "save_pretrained's directory does not load whole: $(grep -E 'init checkpoint: (missing|unexpected)' "$W/eval.log")"
  fi
  "$PY" "$CHECK" import "$W/hf" "$W/logits.safetensors" "$W/eval/eval.json" --tol 1e-5 \
    || fail "the trainer does not reproduce transformers on save_pretrained's model"
  ;;
*) fail "unknown mode '$MODE' (export | import)" ;;
esac
echo "bert_hf_client_$MODE: passed"
