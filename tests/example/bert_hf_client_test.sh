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
#   layouts the streamed export (issue 55) of one training (tiny, dropout 0, 3 steps of 16 rows) at
#           (t, p, d) = (2, 2, 1) stage 1 and (1, 2, 2) stage 3 (4 ranks): k-of-n files and the
#           index, loading in transformers with no missing or unexpected key, the keys and (on one
#           random batch) the logits of the (1, 1, 1) run's unsplit export within 1e-5; every
#           rank's extra memory, as printed, within one tensor as gathered (padded) + 0.25 MiB
# Usage: bert_hf_client_test.sh MODE BERT_PRETRAIN PYTHON CORPUS WORKDIR [MPIEXEC]
set -euo pipefail
MODE="$1" EXE="$2" PY="$3" CORPUS="$4" WORK="$5" MPIEXEC="${6:-mpirun}"
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
layouts)
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  # lr 5e-4: the layouts' trajectories part by fp32 rounding, which Adam turns into weight
  # differences of order lr x rounding noise (at 2e-3 the logits of (2, 2, 1) differed by 7.4e-6)
  L=(--preset tiny --steps 3 --warmup-steps 1 --lr 5e-4 --batch-size 4 --dropout 0 --log-every 1
     --corpus "$CORPUS")
  run() {  # RANKS NAME FLAGS...
    local n="$1" name="$2"; shift 2
    "$MPIEXEC" --oversubscribe --bind-to none -np "$n" "$EXE" "${COMMON[@]}" "${L[@]}" "$@" \
        --export-hf "$W/$name/hf" --out "$W/$name/out" >"$W/$name.log" 2>&1 \
      || { cat "$W/$name.log"; fail "$name"; }
    grep "Hugging Face export" "$W/$name.log" | sed "s/^/$name: /"
    # "extra memory per rank at most X MiB (rank r); one tensor gathered takes at most Y MiB"
    "$PY" - "$W/$name.log" <<'PY' || fail "$name: the export's extra memory exceeds one tensor"
import re, sys
m = re.search(r"extra memory per rank at most ([0-9.]+) MiB .*gathered takes at most ([0-9.]+) MiB", open(sys.argv[1]).read())
extra, one = float(m.group(1)), float(m.group(2))
print(f"extra memory per rank {extra} MiB, one tensor gathered {one} MiB (+ 0.25 MiB of pieces)")
sys.exit(0 if 0 < extra <= one + 0.25 else 1)
PY
  }
  run 1 d1 --grad-accum 4
  run 4 t2p2 --tp 2 --pp 2 --schedule 1f1b --micro-batches 4 --stage 1
  run 4 p2d2 --pp 2 --schedule 1f1b --micro-batches 2 --stage 3
  for r in t2p2 p2d2; do
    "$PY" - "$W/d1/out/metrics.jsonl" "$W/$r/out/metrics.jsonl" <<'PY' || fail "$r: not the same training as d1"
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p) if '"loss"' in l] for p in sys.argv[1:3])
print(f"losses: d1 {a}, {sys.argv[2]} {b}")
sys.exit(0 if len(a) == len(b) == 3 and max(abs(x - y) for x, y in zip(a, b)) < 1e-4 else 1)
PY
  done
  "$PY" "$CHECK" layouts "$W/d1/hf" "$W/t2p2/hf" "$W/p2d2/hf" --tol 1e-5 \
    || fail "the streamed exports do not load as the unsplit one"
  ;;
*) fail "unknown mode '$MODE' (export | import | layouts)" ;;
esac
echo "bert_hf_client_$MODE: passed"
