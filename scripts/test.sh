#!/usr/bin/env bash
# Builds shardopt and runs the whole test suite (unit, multi-rank under mpirun for N = 1..4,
# packaging, Python). Fails when any test fails or when no test ran.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${SHARDOPT_BUILD_DIR:-$ROOT/build}"
"$ROOT/scripts/build.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cd "$BUILD"
LOG="$BUILD/last-test.log"
set +e
ctest --output-on-failure "$@" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
set -e
if ! grep -qE '^[0-9]+% tests passed, [0-9]+ tests failed out of [1-9][0-9]*' "$LOG"; then
  echo "[test] no test ran: that is a failure" >&2
  exit 1
fi
exit "$rc"
