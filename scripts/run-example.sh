#!/usr/bin/env bash
# The README's first command: builds bert_pretrain, then pretrains a small BERT on 2 ranks (mpirun)
# with ZeRO stage 2 on the default corpus, manpages-intl (the Linux man-pages of Debian's
# manpages-dev and their French, German and Spanish translations; scripts/setup.sh installs them),
# holding 5% of its documents out for evaluation. Extra arguments are passed to bert_pretrain and
# win over the defaults below (`bert_pretrain --help`; e.g. --corpus licenses for a fast run).
# Outputs in out/bert/: metrics.jsonl, loss.png, summary.json, checkpoint/ (the final state, and
# every 200 steps; --resume continues), model.pt (consolidated), hf/ (the Hugging Face export),
# config.json; cache/ keeps the vocabulary and
# the data, keyed by the corpus files and the options, so a second run skips them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${SHARDOPT_BUILD_DIR:-$ROOT/build}"
NP="${NP:-2}"

"$ROOT/scripts/build.sh" --target bert_pretrain shardopt_consolidate

# mpirun gives ranks a pseudo-terminal even when its own output is a file: decide here.
progress=lines
if [ -t 1 ]; then progress=tty; fi
# One torch/BLAS thread per rank: ranks x threads must not exceed the cores.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
cd "$ROOT"
OUT="$ROOT/out/bert"
prev=""
for arg in "$@"; do  # the trainer takes the last --out; so does this summary
  case "$prev" in --out) OUT="$arg" ;; esac
  case "$arg" in --out=*) OUT="${arg#--out=}" ;; esac
  prev="$arg"
done
# BERT-tiny, 32 sequences of up to 128 tokens per rank and step: next-sentence prediction needs
# many sequences more than a deep model (examples/bert/README.md, "What to expect"). Dropout is
# off (BERT's 0.1 is the binary's default): in a run this short it only slows learning.
start=$(date +%s)
rc=0
mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$NP" \
  "$BUILD/examples/bert_pretrain" \
  --preset tiny --stage 2 --max-seq-length 128 --batch-size 32 --dupe-factor 2 \
  --steps 600 --warmup-steps 60 --lr 2e-3 --dropout 0 --weight-decay 0.01 --max-grad-norm 1.0 \
  --vocab-size 8000 --threads 1 --log-every 20 --progress "$progress" \
  --eval-every 100 --checkpoint-every 200 --save-model \
  --out "$ROOT/out/bert" "$@" || rc=$?
echo
echo "[run-example] wall time: $(( $(date +%s) - start )) s (exit code $rc)"
if [ -f "$OUT/summary.json" ]; then
  python3 - "$OUT/summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
e, f = s.get("eval"), s.get("first_eval")
if e:
    print(f"[run-example] held-out eval ({e['instances']} instances): MLM loss {f['mlm_loss']:.3f} "
          f"(step {f['step']}) -> {e['mlm_loss']:.3f} (step {e['step']}), MLM accuracy {e['mlm_acc']:.3f}")
    if s.get("nsp"):
        print(f"[run-example] NSP accuracy {e['nsp_acc']:.3f} vs majority baseline "
              f"{e['nsp_baseline']:.3f} ({e['nsp_acc'] - e['nsp_baseline']:+.3f})")
print(f"[run-example] final model: {s['model'] or '(not written: pass --save-model)'}")
if s.get("hf_export"):
    print(f"[run-example] Hugging Face: {s['hf_export']} (BertForPreTraining.from_pretrained)")
print(f"[run-example] checkpoint:  {s['checkpoint']} (step {s['step']}; continue: "
      "scripts/run-example.sh --resume)")
EOF
fi
echo "[run-example] metrics:     $OUT/metrics.jsonl, summary: $OUT/summary.json"
plot_note=""
[ -f "$OUT/loss.png" ] || plot_note="  (not drawn)"
echo "[run-example] loss plot:   $OUT/loss.png$plot_note"
exit "$rc"
