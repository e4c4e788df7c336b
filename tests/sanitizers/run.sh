#!/usr/bin/env bash
# scripts/test.sh --sanitize SANITIZERS [ctest args]: builds shardopt's library, unit tests, BERT
# tests and multi-rank tests with -fsanitize=SANITIZERS (e.g. address,undefined) in their own
# build directory and runs them under the runtime options of tests/sanitizers/README.md. Fails
# when a test fails or when any sanitizer report appears in the output.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
sanitizers="$1"
shift
# ThreadSanitizer cannot share a process with ASan: its own build directory, and only the
# multi-rank tests of the engine (the threads are the communicators' workers beside autograd's).
thread=0
case ",$sanitizers," in
  ,thread,) thread=1 ;;
  *,thread,*) echo "[sanitize] thread goes alone (ThreadSanitizer excludes the others)" >&2; exit 2 ;;
esac
if [ $thread = 1 ]; then
  export SHARDOPT_BUILD_DIR="${SHARDOPT_SANITIZE_BUILD_DIR:-$ROOT/build-tsan}"
  targets="dist_tests pipeline_tests thread_tests"
else
  export SHARDOPT_BUILD_DIR="${SHARDOPT_SANITIZE_BUILD_DIR:-$ROOT/build-sanitize}"
  targets="unit_tests dist_tests bert_tests pipeline_tests thread_tests"
fi
# -O1: the sanitizers' usual level (readable stacks, a third of -O3's compile time here).
export SHARDOPT_CMAKE_ARGS="-DSHARDOPT_SANITIZE=$sanitizers -DCMAKE_BUILD_TYPE=RelWithDebInfo \
-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 \
-DSHARDOPT_BUILD_PYTHON=OFF -DSHARDOPT_BUILD_BENCH=OFF ${SHARDOPT_CMAKE_ARGS:-}"
start=$SECONDS
"$ROOT/scripts/build.sh" --target $targets
echo "[sanitize] build: $((SECONDS - start)) s"

S="$ROOT/tests/sanitizers"
# Note [Sanitizer options] (reasons in tests/sanitizers/README.md).
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:${ASAN_OPTIONS:-}"
export LSAN_OPTIONS="suppressions=$S/lsan.supp:print_suppressions=0:${LSAN_OPTIONS:-}"
export UBSAN_OPTIONS="suppressions=$S/ubsan.supp:print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
export TSAN_OPTIONS="suppressions=$S/tsan.supp:second_deadlock_stack=1:${TSAN_OPTIONS:-}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# The unit tests, the BERT example's readers, the pipeline schedules, and the multi-rank tests of
# the paths that parse and move bytes (checkpoints, buffers), the four stages, non-finite handling,
# the communicators' collectives and point-to-point, and the pipeline executor, at two ranks
# (tests/sanitizers/README.md gives the cost of more).
default_tests='^(unit|unit_kernels_env_scalar|bert_unit|pipeline_schedules|checkpoint_np2|checkpoint_buffers_np2|stages_np2|nonfinite_np2|comm_np2|p2p_np2|pipeline_np2|threads_stages_n3|threads_tensor_parallel_n2)$'
# ThreadSanitizer: the engine's multi-rank tests where a worker thread runs beside the caller.
if [ $thread = 1 ]; then
  default_tests='^(comm_np2|stages_np2|nonfinite_np2|contract_np2|p2p_np2|pipeline_np2|checkpoint_np2|threads_stages_n3|threads_tensor_parallel_n2)$'
fi
cd "$SHARDOPT_BUILD_DIR"
LOG="$SHARDOPT_BUILD_DIR/last-sanitize.log"
set +e
if [ $# -eq 0 ]; then
  ctest --output-on-failure -R "$default_tests" 2>&1 | tee "$LOG"
else
  ctest --output-on-failure "$@" 2>&1 | tee "$LOG"
fi
rc=${PIPESTATUS[0]}
set -e
# A report in a child whose exit status a test does not check still fails the run.
reports=$(grep -cE 'ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:|WARNING: ThreadSanitizer' "$LOG" || true)
echo "[sanitize] $sanitizers: $reports sanitizer report(s); tests exit $rc; $((SECONDS - start)) s in all"
if ! grep -qE '^[0-9]+% tests passed, [0-9]+ tests failed out of [1-9][0-9]*' "$LOG"; then
  echo "[sanitize] no test ran: that is a failure" >&2
  exit 1
fi
[ "$reports" -eq 0 ] || exit 1
exit "$rc"
