#!/usr/bin/env bash
# shardopt's BERT trainer vs the peers users would pick instead, on this machine, in one run:
# torch DDP (+ ZeroRedundancyOptimizer), DeepSpeed ZeRO-1/2/3 (torch AdamW and DeepSpeedCPUAdam)
# and FSDP2 (reshard_after_forward on and off), all over Gloo from the pip platform's venv
# (bench/peers/), beside shardopt's own rows: `bert_pretrain --stage 0..3` and shardopt from Python
# (bench/peers/shardopt_py.py: the peers' harness through the bindings, over MPI as the trainer;
# keys shardopt:s0..s3); same model, data, batch, threads and steps. Each peer (and each Python
# row) first runs once for parity against single-process torch.optim.AdamW; prints a markdown
# table (parity, step time, CPU time, RSS, model state, bytes communicated) and the goals per stage.
#
#   bench/compare_peers.sh                           # every peer, stages 0-3, 20 timed steps after 5
#   bench/compare_peers.sh --rounds 3                # the acceptance run (needs a quiet machine)
#   bench/compare_peers.sh --peers torch:zero,fsdp2:reshard --stages 1,3 --steps 10
#   bench/compare_peers.sh --peers shardopt:s1,torch:zero --stages 1   # Python vs C++ vs torch
#
# Options are those of bench/compare_peers.py (--help). The trainer and the Python module are the
# pip platform's build (build-pip/, made on demand with scripts/platform.sh pip scripts/build.sh
# --target bert_pretrain shardopt_python; the module from build-pip/python), so all sides use the
# same libtorch; SHARDOPT_BUILD_DIR names another build dir (with both targets), PYTHON another
# Python (it needs torch, DeepSpeed and ninja). DeepSpeedCPUAdam and DeepSpeed's shm comm op are
# JIT-built on first use into TORCH_EXTENSIONS_DIR (default /var/cache/shardopt/torch_extensions,
# outside the clone; a few minutes once).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${SHARDOPT_BUILD_DIR:-$ROOT/build-pip}"
if [ -z "${PYTHON:-}" ]; then
  PYTHON="$("$ROOT/scripts/pip-venv.sh")/bin/python"
fi
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/var/cache/shardopt/torch_extensions}"
# DeepSpeed's JIT build runs ninja from PATH.
export PATH="$(dirname "$PYTHON"):$PATH"
TRAINER="$BUILD/examples/bert_pretrain"
if [ ! -x "$TRAINER" ] || ! ls "$BUILD"/python/shardopt/_C*.so >/dev/null 2>&1; then
  echo "[compare] $TRAINER or $BUILD/python/shardopt is missing: building them" >&2
  if [ "$BUILD" = "$ROOT/build-pip" ]; then
    "$ROOT/scripts/platform.sh" pip scripts/build.sh --target bert_pretrain shardopt_python
  else
    SHARDOPT_BUILD_DIR="$BUILD" "$ROOT/scripts/build.sh" --target bert_pretrain shardopt_python
  fi
fi
exec "$PYTHON" "$ROOT/bench/compare_peers.py" --trainer "$TRAINER" --python "$PYTHON" "$@"
