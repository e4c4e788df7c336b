#!/usr/bin/env bash
# The README's first command: builds bert_pretrain, then pretrains BERT-mini on 2 ranks (mpirun)
# with ZeRO stage 2 on /usr/share/common-licenses (or --corpus PATH...). Extra arguments are passed
# to bert_pretrain and win over the defaults below (see `bert_pretrain --help`).
# Outputs in out/bert/: metrics.jsonl, loss.png, summary.json; cache/ keeps the learned vocabulary
# and the pretraining data, keyed by corpus content and options, so a second run skips them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${SHARDOPT_BUILD_DIR:-$ROOT/build}"
NP="${NP:-2}"

"$ROOT/scripts/build.sh" --target bert_pretrain

# mpirun gives ranks a pseudo-terminal, so decide here whether progress may use '\r'.
progress=lines
if [ -t 1 ]; then progress=tty; fi
# One torch/BLAS thread per rank: ranks x threads must not exceed the cores.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
cd "$ROOT"
# 600 steps of 16 x 128 tokens take ~4 minutes on 2 idle cores. Dropout is off (BERT's 0.1 is the
# binary's default): in a run this short it keeps the model at unigram statistics much longer.
exec mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$NP" \
  "$BUILD/examples/bert_pretrain" \
  --preset mini --stage 2 --max-seq-length 128 --batch-size 8 --dupe-factor 10 \
  --steps 600 --warmup-steps 60 --lr 1e-3 --dropout 0 --weight-decay 0.01 --max-grad-norm 1.0 \
  --vocab-size 8000 --threads 1 --log-every 10 --progress "$progress" \
  --out "$ROOT/out/bert" "$@"
