#!/usr/bin/env bash
# shardopt's pipeline (gpt_train --pp 2, 1f1b and zb-h1) against torch.distributed.pipelining
# (Schedule1F1B, ScheduleInterleavedZeroBubble with one stage per rank) on the same GPT, p = 2,
# one thread per rank: parity in float64 first, then step time and max RSS in float32, interleaved
# (bench/pipeline_vs_torch.py --help). The torch side runs from the pip platform's venv;
# gpt_train is build/examples/gpt_train (made on demand; SHARDOPT_BUILD_DIR names another build).
#
#   bench/pipeline_vs_torch.sh                       # GPT 4 x 256, seq 128, 8 micro-batches of 4
#   bench/pipeline_vs_torch.sh --parity-only --preset tiny --n-ctx 128 --hidden 64 --heads 4
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${SHARDOPT_BUILD_DIR:-$ROOT/build}"
PYTHON="${PYTHON:-$("$ROOT/scripts/pip-venv.sh" 2>/dev/null)/bin/python}"
if [ ! -x "$BUILD/examples/gpt_train" ]; then
  echo "[pipeline_vs_torch] $BUILD/examples/gpt_train is missing: building it" >&2
  SHARDOPT_BUILD_DIR="$BUILD" "$ROOT/scripts/build.sh" --target gpt_train
fi
exec "$PYTHON" "$ROOT/bench/pipeline_vs_torch.py" --trainer "$BUILD/examples/gpt_train" \
  --python "$PYTHON" "$@"
