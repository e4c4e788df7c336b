#!/usr/bin/env bash
# Builds shardopt and runs the whole test suite (unit, multi-rank under mpirun for N = 1..4,
# packaging, Python). Fails when any test fails or when no test ran. Prints what was skipped, and
# why, after CTest's summary.
#   scripts/test.sh [ctest args]                      on this machine (Debian 12 in CI)
#   scripts/test.sh --platform debian13 [ctest args]  the same inside a cached Debian 13 root
#                                                     (scripts/platform.sh; needs root)
#   scripts/test.sh --platform pip [ctest args]       against PyPI's torch in a cached venv of
#                                                     this host's Python (scripts/pip-venv.sh)
#   scripts/test.sh --sanitize address,undefined [ctest args]
#                     builds the library, unit, BERT and multi-rank tests with those sanitizers in
#                     build-sanitize/ (SHARDOPT_SANITIZE_BUILD_DIR) and runs the unit tests and a
#                     subset of the multi-rank ones (tests/sanitizers/README.md: which, and why)
#   scripts/test.sh --sanitize thread [ctest args]
#                     ThreadSanitizer alone, in build-tsan/: the engine's multi-rank tests
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "${1:-}" = "--sanitize" ]; then
  [ $# -ge 2 ] || { echo "usage: scripts/test.sh --sanitize address,undefined|thread [ctest args]" >&2; exit 2; }
  sanitizers="$2"
  shift 2
  exec "$ROOT/tests/sanitizers/run.sh" "$sanitizers" "$@"
fi
if [ "${1:-}" = "--platform" ]; then
  [ $# -ge 2 ] || { echo "usage: scripts/test.sh --platform debian13|pip [ctest args]" >&2; exit 2; }
  platform="$2"
  shift 2
  exec "$ROOT/scripts/platform.sh" "$platform" scripts/test.sh "$@"
fi
BUILD="${SHARDOPT_BUILD_DIR:-$ROOT/build}"
"$ROOT/scripts/build.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cd "$BUILD"
LOG="$BUILD/last-test.log"
set +e
ctest --output-on-failure "$@" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
set -e
# GoogleTest's "file:line: Skipped" is followed by the reason; count them per CTest entry.
if [ -f Testing/Temporary/LastTest.log ]; then
  awk '/^[0-9]+\/[0-9]+ Testing: /{entry=$3}
       /: Skipped$/{getline reason; n[entry ": " reason]++; total++}
       /^skipped: /{whole[entry] = substr($0, 10)}
       END{for (k in n) printf "[test] skipped %d in %s\n", n[k], k;
           for (k in whole) printf "[test] skipped CTest entry %s: %s\n", k, whole[k];
           printf "[test] %d GoogleTest cases skipped in all\n", total}' \
    Testing/Temporary/LastTest.log | sort
fi
if ! grep -qE '^[0-9]+% tests passed, [0-9]+ tests failed out of [1-9][0-9]*' "$LOG"; then
  echo "[test] no test ran: that is a failure" >&2
  exit 1
fi
exit "$rc"
