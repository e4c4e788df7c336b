#!/usr/bin/env bash
# The README's first command: builds bert_pretrain, then pretrains BERT-mini on 2 ranks (mpirun)
# with ZeRO stage 2 on /usr/share/common-licenses (or --corpus PATH...). Extra arguments are passed
# to bert_pretrain and win over the defaults below (see `bert_pretrain --help`).
# Outputs in out/bert/: metrics.jsonl, loss.png, summary.json, checkpoint/ (every 100 steps; pass
# --resume to continue an interrupted run); cache/ keeps the learned vocabulary and the
# pretraining data, keyed by corpus content and options, so a second run skips them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${SHARDOPT_BUILD_DIR:-$ROOT/build}"
NP="${NP:-2}"

"$ROOT/scripts/build.sh" --target bert_pretrain shardopt_consolidate

# mpirun gives ranks a pseudo-terminal, so decide here whether progress may use '\r'.
progress=lines
if [ -t 1 ]; then progress=tty; fi
# One torch/BLAS thread per rank: ranks x threads must not exceed the cores.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
cd "$ROOT"
# 600 steps of 16 x 128 tokens take ~4 minutes on 2 idle cores. Dropout is off (BERT's 0.1 is the
# binary's default): in a run this short it keeps the model at unigram statistics much longer.
OUT="$ROOT/out/bert"
prev=""
for arg in "$@"; do  # the trainer takes the last --out; so does this summary
  case "$prev" in --out) OUT="$arg" ;; esac
  case "$arg" in --out=*) OUT="${arg#--out=}" ;; esac
  prev="$arg"
done
rc=0
mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$NP" \
  "$BUILD/examples/bert_pretrain" \
  --preset mini --stage 2 --max-seq-length 128 --batch-size 8 --dupe-factor 10 \
  --steps 600 --warmup-steps 60 --lr 1e-3 --dropout 0 --weight-decay 0.01 --max-grad-norm 1.0 \
  --vocab-size 8000 --threads 1 --log-every 10 --progress "$progress" --checkpoint-every 100 \
  --out "$ROOT/out/bert" "$@" || rc=$?
echo
echo "[run-example] checkpoint: $OUT/checkpoint  (continue: scripts/run-example.sh --resume;"
echo "              one torch.load()-able file: $BUILD/src/tools/shardopt-consolidate $OUT/checkpoint model.pt)"
echo "[run-example] metrics:    $OUT/metrics.jsonl"
plot_note=""
[ -f "$OUT/loss.png" ] || plot_note="  (not drawn)"
echo "[run-example] loss plot:  $OUT/loss.png$plot_note"
exit "$rc"
