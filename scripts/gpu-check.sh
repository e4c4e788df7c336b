#!/usr/bin/env bash
# One command for a GPU machine (PyTorch 2.x with CUDA, nvcc, cmake, ninja; no internet, no MPI,
# fmt, GoogleTest or Google Benchmark): unpacks the carried .debs (scripts/fetch-gpu-debs.sh) into
# a local prefix, configures shardopt against the machine's PyTorch, builds the GPU targets, runs
# the GPU tests and benchmarks, and writes report.md plus the raw outputs to $OUT (or the folder
# given). On a machine without a GPU it goes as far as it can (environment, unpacking, configure)
# and reports the rest as skipped; it exits 0 then. It exits 1 when a phase that ran failed.
#   scripts/gpu-check.sh [--out DIR] [--build-without-gpu] [--quick] [--skip-tests] [--skip-bench]
#     --build-without-gpu  build (and run the skipping tests) even where no GPU is visible
#     --quick              benchmarks on 1e7 parameters and fewer steps (a smoke run)
#     --skip-tests, --skip-bench  leave a phase out, e.g. to split a run over two calls with a
#                          time limit each (build-gpu/ is kept: the second call's build is a no-op)
# Environment: PYTHON (default python3, then /usr/bin/python3), DEBS (default gpu-debs/),
# BUILD (default build-gpu/), CUDA_ARCHS (default: the GPU's compute capability).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="${OUT:-$ROOT/out/gpu-check}"
BUILD_WITHOUT_GPU=0
QUICK=0
SKIP_TESTS=0
SKIP_BENCH=0
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-tests) SKIP_TESTS=1; shift ;;
    --skip-bench) SKIP_BENCH=1; shift ;;
    --out) OUTDIR="$2"; shift 2 ;;
    --build-without-gpu) BUILD_WITHOUT_GPU=1; shift ;;
    --quick) QUICK=1; shift ;;
    *) OUTDIR="$1"; shift ;;
  esac
done
DEBS="${DEBS:-$ROOT/gpu-debs}"
BUILD="${BUILD:-$ROOT/build-gpu}"
PREFIX="$BUILD/prefix"
mkdir -p "$OUTDIR" "$BUILD"
OUTDIR="$(cd "$OUTDIR" && pwd)"
REPORT="$OUTDIR/report.md"
STATUS="$OUTDIR/phases.txt"
: >"$STATUS"
failed=0

log() { echo "[gpu-check] $*" >&2; }
# phase NAME STATUS DETAIL: one line of the report's phase table.
phase() {
  printf '| %s | %s | %s |\n' "$1" "$2" "$3" >>"$STATUS"
  log "$1: $2 ${3:+($3)}"
  if [ "$2" = "FAILED" ]; then failed=1; fi
}
# run_logged NAME TIMEOUT_S CMD...: output to $OUTDIR/NAME.log; returns the command's status.
run_logged() {
  local name="$1" limit="$2"
  shift 2
  timeout "$limit" "$@" >"$OUTDIR/$name.log" 2>&1
}

# ---- environment ----------------------------------------------------------------------------
{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(uname -srm)"
  echo "glibc: $(ldd --version 2>/dev/null | head -1)"
  echo "cpu: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)"
  echo "cmake: $(cmake --version 2>/dev/null | head -1)"
  echo "ninja: $(ninja --version 2>/dev/null)"
  NVCC="$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)"
  echo "nvcc: ${NVCC:-none} $($NVCC --version 2>/dev/null | tail -1)"
  echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>/dev/null || echo none)"
} >"$OUTDIR/environment.txt"
NVCC="$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)"
PY=""
for candidate in "${PYTHON:-python3}" /usr/bin/python3; do
  if "$candidate" -c 'import torch' >/dev/null 2>&1; then PY="$candidate"; break; fi
done
HAVE_GPU=0
if [ -n "$PY" ]; then
  "$PY" - >>"$OUTDIR/environment.txt" 2>&1 <<'EOF'
import torch
print(f"torch: {torch.__version__} cuda {torch.version.cuda} cxx11_abi {torch.compiled_with_cxx11_abi()}")
print(f"torch.cuda.is_available: {torch.cuda.is_available()}")
print(f"torch cmake prefix: {torch.utils.cmake_prefix_path}")
EOF
  if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    HAVE_GPU=1
  fi
  phase environment ok "python $PY, torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  phase environment ok "no Python with torch: cannot configure against PyTorch"
fi
[ "$HAVE_GPU" = 1 ] || log "no GPU visible to torch"

# ---- unpack the carried packages --------------------------------------------------------------
unpack() {
  local deb="$1" tmp
  if command -v dpkg-deb >/dev/null; then
    dpkg-deb -x "$deb" "$PREFIX"
    return
  fi
  tmp="$(mktemp -d)"
  (cd "$tmp" && ar x "$deb") || return 1
  tar -xf "$tmp"/data.tar.* -C "$PREFIX"
  rm -rf "$tmp"
}
if ls "$DEBS"/*.deb >/dev/null 2>&1; then
  # Unpacked once per set of packages: fresh header timestamps would rebuild everything.
  stamp="$(cd "$DEBS" && ls -l -- *.deb | md5sum | cut -d' ' -f1)"
  if [ "$(cat "$PREFIX/.debs" 2>/dev/null)" = "$stamp" ]; then
    phase unpack ok "already unpacked in $PREFIX"
  else
    rm -rf "$PREFIX"
    mkdir -p "$PREFIX"
    ok=1
    for deb in "$DEBS"/*.deb; do unpack "$deb" || { ok=0; log "could not unpack $deb"; }; done
    if [ "$ok" = 1 ]; then
      echo "$stamp" >"$PREFIX/.debs"
      phase unpack ok "$(ls "$DEBS"/*.deb | wc -l) packages into $PREFIX"
    else
      phase unpack FAILED "see the log above"
    fi
  fi
else
  phase unpack skipped "no .debs in $DEBS (run scripts/fetch-gpu-debs.sh where there is internet)"
fi

# ---- configure and build ------------------------------------------------------------------------
configured=0
built=0
if [ -z "$PY" ]; then
  phase configure skipped "no PyTorch"
else
  TORCH_PREFIX="$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
  args=(-S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
        "-DCMAKE_PREFIX_PATH=$TORCH_PREFIX;$PREFIX/usr;$PREFIX/usr/lib/x86_64-linux-gnu/cmake"
        -DSHARDOPT_FMT_HEADER_ONLY=ON -DSHARDOPT_WITH_MPI=OFF
        -DSHARDOPT_BUILD_PYTHON=OFF -DSHARDOPT_BUILD_TESTS=ON -DSHARDOPT_BUILD_BENCH=ON)
  [ -d "$PREFIX/usr/include/fmt" ] && args+=("-DSHARDOPT_FMT_INCLUDE_DIR=$PREFIX/usr/include")
  [ -d "$PREFIX/usr/src/googletest" ] && args+=("-DSHARDOPT_GTEST_SOURCE_DIR=$PREFIX/usr/src/googletest")
  [ -n "$NVCC" ] && args+=("-DCMAKE_CUDA_COMPILER=$NVCC")
  archs="${CUDA_ARCHS:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')}"
  [ -n "$archs" ] && args+=("-DCMAKE_CUDA_ARCHITECTURES=$archs")
  # pip wheels carry NCCL in nvidia/nccl (libnccl.so.2, no libnccl.so link).
  nccl_dir="$("$PY" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)"
  if [ -n "$nccl_dir" ] && [ ! -e /usr/local/cuda/include/nccl.h ]; then
    nccl_lib="$(ls "$nccl_dir"/lib/libnccl.so* 2>/dev/null | head -1)"
    [ -n "$nccl_lib" ] && args+=("-DNCCL_INCLUDE_DIR=$nccl_dir/include" "-DNCCL_LIBRARY=$nccl_lib")
  fi
  # The BERT example (bert_pretrain --device cuda) where its libraries were carried: utf8proc
  # through pkg-config, pointed at the unpacked prefix. Without them, or if that configure fails,
  # the GPU targets are configured without it.
  examples=OFF
  if [ -f "$PREFIX/usr/include/utf8proc.h" ] && command -v pkg-config >/dev/null; then
    export PKG_CONFIG_SYSROOT_DIR="$PREFIX"
    export PKG_CONFIG_LIBDIR="$PREFIX/usr/lib/x86_64-linux-gnu/pkgconfig:$PREFIX/usr/share/pkgconfig"
    examples=ON
  fi
  printf '%q ' cmake "${args[@]}" "-DSHARDOPT_BUILD_EXAMPLES=$examples" >"$OUTDIR/configure.cmd"
  if run_logged configure 300 cmake "${args[@]}" "-DSHARDOPT_BUILD_EXAMPLES=$examples"; then
    configured=1
  elif [ "$examples" = ON ]; then
    mv "$OUTDIR/configure.log" "$OUTDIR/configure-with-example.log"
    rm -f "$BUILD/CMakeCache.txt"
    examples=OFF
    run_logged configure 300 cmake "${args[@]}" -DSHARDOPT_BUILD_EXAMPLES=OFF && configured=1
  fi
  if [ "$configured" = 1 ]; then
    phase configure ok "$(grep -m1 'shardopt 0' "$OUTDIR/configure.log" | sed 's/^-- //'), BERT example $examples"
  else
    phase configure FAILED "see configure.log"
  fi
fi
export LD_LIBRARY_PATH="$BUILD:$PREFIX/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
targets=(gpu_tests gpu_kernels_bench gpu_bert_step bert_pretrain)
if [ "$configured" = 1 ]; then
  if [ "$HAVE_GPU" = 0 ] && [ "$BUILD_WITHOUT_GPU" = 0 ]; then
    phase build skipped "no GPU (--build-without-gpu builds anyway)"
  else
    # The list is read once: `ninja ... | grep -q` under pipefail fails at random when grep's early
    # exit kills ninja with SIGPIPE, which once dropped three of the four targets.
    all_targets="$(ninja -C "$BUILD" -t targets all 2>/dev/null)"
    present=()
    for t in "${targets[@]}"; do
      grep -q "^$t: " <<<"$all_targets" && present+=("$t")
    done
    if run_logged build 1800 cmake --build "$BUILD" --target "${present[@]}" -- -k 0; then  # -k 0: every error in one log
      built=1
      phase build ok "targets: ${present[*]}"
    else
      phase build FAILED "see build.log"
    fi
  fi
else
  phase build skipped "not configured"
fi

# ---- tests ------------------------------------------------------------------------------------
if [ "$SKIP_TESTS" = 1 ]; then
  phase tests skipped "--skip-tests"
elif [ "$built" = 1 ] && [ -x "$BUILD/tests/gpu_tests" ]; then
  run_logged gpu_tests 900 "$BUILD/tests/gpu_tests" --gtest_output="json:$OUTDIR/gpu_tests.json"
  rc=$?
  summary="$(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\] [0-9]+ tests?[.,]' "$OUTDIR/gpu_tests.log" | sed 's/, listed below://' | tr -s ' []\n' ' ')"
  if [ "$rc" = 0 ]; then phase tests ok "$summary"; else phase tests FAILED "rc $rc: $summary"; fi
else
  phase tests skipped "$([ "$HAVE_GPU" = 1 ] && echo "not built" || echo "no GPU")"
fi

# ---- the BERT example on the GPU: BERT-base bf16 for 50 steps at stages 2 and 3 (the figures the
# report quotes), BERT-tiny fp16 at stage 2 (dynamic loss scaling) and fp32 at stage 3. No
# --check-loss-decrease: --synthetic draws tokens uniformly, so the loss starts at its floor,
# ln(30522) = 10.33, and only wanders; correctness is the GPU tests' job ------------------------
if [ "$SKIP_TESTS" = 1 ]; then
  phase bert_example skipped "--skip-tests"
elif [ "$HAVE_GPU" = 1 ] && [ "$built" = 1 ] && [ -x "$BUILD/examples/bert_pretrain" ]; then
  ok=1
  # stage precision preset steps batch seq
  for run in "2 bf16 base 50 32 128" "3 bf16 base 50 32 128" "2 fp16 tiny 50 8 64" \
             "3 fp32 tiny 50 8 64"; do
    set -- $run
    name="bert_cuda_$3_stage$1_$2"
    run_logged "$name" 600 "$BUILD/examples/bert_pretrain" --device cuda --synthetic --preset "$3" \
      --steps "$4" --batch-size "$5" --max-seq-length "$6" --warmup-steps 5 --stage "$1" \
      --precision "$2" --no-plot --progress lines --log-every 10 \
      --out "$OUTDIR/$name" || { ok=0; log "$name failed (see $name.log)"; }
    rm -rf "$OUTDIR/$name/checkpoint"  # hundreds of MB for BERT-base; the log has the figures
  done
  if [ "$ok" = 1 ]; then
    phase bert_example ok "bert_pretrain --device cuda: base bf16 stages 2/3 (50 steps), tiny fp16 stage 2, fp32 stage 3"
  else phase bert_example FAILED "see bert_cuda_*.log"; fi
else
  phase bert_example skipped "$([ "$HAVE_GPU" = 1 ] && echo "bert_pretrain not built (no utf8proc carried?)" || echo "no GPU")"
fi

# ---- benchmarks -------------------------------------------------------------------------------
numel=100000000
steps=30  # 10 gave medians 25-45% apart between machines and runs
if [ "$QUICK" = 1 ]; then numel=10000000; steps=3; fi
bench() {  # bench NAME CMD...: JSON on stdout into NAME.json, stderr into NAME.log
  local name="$1"
  shift
  if timeout 900 "$@" >"$OUTDIR/$name.json" 2>"$OUTDIR/$name.log"; then
    phase "bench $name" ok "$(tr -d '\n' <"$OUTDIR/$name.json" | cut -c1-120)"
  else
    phase "bench $name" FAILED "see $name.log"
  fi
}
if [ "$SKIP_BENCH" = 1 ]; then
  phase benchmarks skipped "--skip-bench"
elif [ "$HAVE_GPU" = 1 ] && [ "$built" = 1 ]; then
  [ -x "$BUILD/bench/gpu_kernels_bench" ] && bench kernels "$BUILD/bench/gpu_kernels_bench" --numel "$numel"
  bench kernels_torch "$PY" "$ROOT/bench/gpu_adamw_peer.py" --numel "$numel"
  bench bert_stage2 "$BUILD/bench/gpu_bert_step" --stage 2 --steps "$steps"
  bench bert_stage3 "$BUILD/bench/gpu_bert_step" --stage 3 --units explicit --steps "$steps"
  bench bert_stage3_auto "$BUILD/bench/gpu_bert_step" --stage 3 --units auto --steps "$steps"
  bench bert_torch "$PY" "$ROOT/bench/gpu_bert_peer.py" --steps "$steps"
else
  phase benchmarks skipped "$([ "$HAVE_GPU" = 1 ] && echo "not built" || echo "no GPU")"
fi

# ---- report -----------------------------------------------------------------------------------
{
  echo "# shardopt GPU check"
  echo
  if [ "$HAVE_GPU" = 0 ]; then
    echo "**skipped: no GPU** (torch sees no CUDA device); what could run without one ran."
    echo
  fi
  echo '```'
  cat "$OUTDIR/environment.txt"
  echo '```'
  echo
  echo "| phase | status | detail |"
  echo "|---|---|---|"
  cat "$STATUS"
  echo
  if [ -n "$PY" ] && ls "$OUTDIR"/*.json >/dev/null 2>&1; then
    "$PY" "$ROOT/bench/gpu_report.py" "$OUTDIR" 2>&1
  fi
  echo
  echo "Raw outputs: $(cd "$OUTDIR" && ls | grep -v '^report.md$' | tr '\n' ' ')"
} >"$REPORT"
cat "$REPORT"
exit "$failed"
