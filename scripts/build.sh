#!/usr/bin/env bash
# Configures (once) and builds shardopt in build/ with CMake + Ninja, Release. Incremental.
# Extra arguments are passed to `cmake --build` (e.g. --target bert_pretrain).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${SHARDOPT_BUILD_DIR:-$ROOT/build}"
"$ROOT/scripts/setup.sh"
if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release ${SHARDOPT_CMAKE_ARGS:-}
fi
cmake --build "$BUILD" "$@"
