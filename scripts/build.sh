#!/usr/bin/env bash
# Configures (once) and builds shardopt in build/ with CMake + Ninja, Release. Incremental.
# Extra arguments are passed to `cmake --build` (e.g. --target bert_pretrain).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${SHARDOPT_BUILD_DIR:-$ROOT/build}"
"$ROOT/scripts/setup.sh"
# ccache: paths relative to the checkout, so clones and worktrees share hits; PCH-safe.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$(dirname "$ROOT")}"
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"
if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release ${SHARDOPT_CMAKE_ARGS:-}
fi
cmake --build "$BUILD" "$@"
