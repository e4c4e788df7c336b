#!/usr/bin/env bash
# Builds the libFuzzer harnesses with clang (Debian's clang 14: -fsanitize=fuzzer) into
# build-fuzz/ and, with --run SECONDS, fuzzes each from its seed corpus (a copy: new inputs go to
# build-fuzz/corpus-<name>, crashes to build-fuzz/crash-<name>-*).
#   tests/fuzz/build.sh [--run SECONDS ["NAME ..."]]  (names: safetensors manifest bert_config
#                      vocab data corpus checkpoint_dir torch_load state_dict_file; default all)
# The torch-linked harnesses use Debian's libtorch; FUZZ_TORCH=<torch package dir> (pip's
# site-packages/torch, with SHARDOPT_BUILD_DIR=build-pip) builds them against that torch instead
# (C++20, as its headers require), e.g. to tell torch 1.13's reader crashes from ours.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${SHARDOPT_FUZZ_BUILD_DIR:-$ROOT/build-fuzz}"
CXX="${FUZZ_CXX:-clang++}"
mkdir -p "$OUT"
flags=(-std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all)
"$CXX" "${flags[@]}" -I"$ROOT/include" "$ROOT/tests/fuzz/safetensors_fuzz.cpp" \
  "$ROOT/src/checkpoint/safetensors.cpp" -lfmt -o "$OUT/safetensors_fuzz"
echo "[fuzz] built $OUT/safetensors_fuzz"
# BERT's torch-free readers: config (JSON), vocab.txt (+ the tokenizer), the pretraining data file.
B="$ROOT/examples/bert"
"$CXX" "${flags[@]}" -I"$B" -I"$ROOT/include" "$ROOT/tests/fuzz/bert_config_fuzz.cpp" \
  "$B/bert_config.cpp" -lfmt -o "$OUT/bert_config_fuzz"
"$CXX" "${flags[@]}" -I"$B" "$ROOT/tests/fuzz/vocab_fuzz.cpp" "$B/tokenizer.cpp" -lutf8proc \
  -o "$OUT/vocab_fuzz"
"$CXX" "${flags[@]}" -I"$B" "$ROOT/tests/fuzz/data_fuzz.cpp" "$B/data.cpp" "$B/data_check.cpp" \
  "$B/corpus.cpp" "$B/tokenizer.cpp" -lutf8proc -lfmt -lz -o "$OUT/data_fuzz"
"$CXX" "${flags[@]}" -I"$B" "$ROOT/tests/fuzz/corpus_fuzz.cpp" "$B/data.cpp" "$B/data_check.cpp" \
  "$B/corpus.cpp" "$B/tokenizer.cpp" -lutf8proc -lfmt -lz -o "$OUT/corpus_fuzz"
echo "[fuzz] built $OUT/bert_config_fuzz $OUT/vocab_fuzz $OUT/data_fuzz $OUT/corpus_fuzz"
# The manifest parser and its checks compiled with coverage; the rest (Error, CRC-32, files) from
# the ordinary build's libshardopt.so (scripts/build.sh first), libtorch from the system.
BUILD="${SHARDOPT_BUILD_DIR:-$ROOT/build}"
[ -f "$BUILD/libshardopt.so" ] || { echo "[fuzz] $BUILD/libshardopt.so missing: run scripts/build.sh" >&2; exit 1; }
if [ -n "${FUZZ_TORCH:-}" ]; then
  # after -std=c++17: the last one counts. fmt header-only, as the pip build takes it (CMakeLists.txt).
  flags+=(-std=c++20 -DFMT_HEADER_ONLY)
  fmt_lib=()
  torch_inc=(-I"$FUZZ_TORCH/include" -I"$FUZZ_TORCH/include/torch/csrc/api/include")
  torch_lib=(-L"$FUZZ_TORCH/lib" -Wl,-rpath,"$FUZZ_TORCH/lib")
else
  torch_inc=(-I/usr/include/torch/csrc/api/include)
  torch_lib=()
  fmt_lib=(-lfmt)
fi
"$CXX" "${flags[@]}" -D_GLIBCXX_USE_CXX11_ABI=1 -I"$ROOT/include" -I"$ROOT/src" -I"$BUILD/include" "${torch_inc[@]}" \
  "$ROOT/tests/fuzz/manifest_fuzz.cpp" "$ROOT/src/checkpoint/manifest.cpp" \
  "$ROOT/src/checkpoint/format.cpp" -L"$BUILD" -lshardopt "${torch_lib[@]}" -ltorch_cpu -lc10 "${fmt_lib[@]}" -lz \
  -Wl,-rpath,"$BUILD" -o "$OUT/manifest_fuzz"
echo "[fuzz] built $OUT/manifest_fuzz"
# The optimizer-state readers: checkpoint directories, torch::load into the optimizer, torch.save
# files of full state dicts. src/checkpoint's readers compiled with coverage (once, shared), the
# rest of the library from libshardopt.so as above.
torch_flags=(-D_GLIBCXX_USE_CXX11_ABI=1 -I"$ROOT/include" -I"$ROOT/src" -I"$ROOT/tests"
             -I"$BUILD/include" "${torch_inc[@]}")
mkdir -p "$OUT/obj"
for src in manifest format files staging save_load full_state torch_save_reader state_dict \
           torch_archive; do
  "$CXX" "${flags[@]}" "${torch_flags[@]}" -c "$ROOT/src/checkpoint/$src.cpp" -o "$OUT/obj/$src.o"
done
fuzz_link() {  # name objects...
  local name="$1"; shift
  "$CXX" "${flags[@]}" "${torch_flags[@]}" "$ROOT/tests/fuzz/${name}_fuzz.cpp" "$@" -L"$BUILD" \
    -lshardopt "${torch_lib[@]}" -ltorch_cpu -lc10 "${fmt_lib[@]}" -lz -Wl,-rpath,"$BUILD" -o "$OUT/${name}_fuzz"
  echo "[fuzz] built $OUT/${name}_fuzz"
}
O="$OUT/obj"
fuzz_link checkpoint_dir "$O/manifest.o" "$O/format.o" "$O/files.o" "$O/staging.o" \
  "$O/save_load.o" "$O/full_state.o" "$O/torch_save_reader.o"
fuzz_link torch_load "$O/torch_archive.o" "$O/state_dict.o" "$O/staging.o"
fuzz_link state_dict_file "$O/full_state.o" "$O/torch_save_reader.o" "$O/files.o" "$O/staging.o"
if [ "${1:-}" = "--run" ]; then
  seconds="${2:-60}"
  for name in ${3:-safetensors manifest bert_config vocab data corpus checkpoint_dir torch_load state_dict_file}; do
    mkdir -p "$OUT/corpus-$name"
    for seed in "$ROOT/tests/fuzz/corpus/$name"/*; do  # *.hex seeds are binary inputs as text
      base="$(basename "$seed" .hex)"
      [ -e "$OUT/corpus-$name/$base" ] && continue
      if [ "$seed" != "${seed%.hex}" ]; then /usr/bin/python3 -c "import sys; sys.stdout.buffer.write(bytes.fromhex(open(sys.argv[1]).read()))" "$seed" >"$OUT/corpus-$name/$base"; else cp "$seed" "$OUT/corpus-$name/"; fi
    done
    # -malloc_limit_mb: one allocation beyond the input's size shows as an out-of-memory report.
    # -rss_limit_mb is the whole process: the manifest harness loads libtorch (~380 MB resident
    # before the first input) and its corpus grows, so 512 stopped a 5M-run campaign with no
    # input at fault (empty crash file).
    # The optimizer-state seeds (a checkpoint directory, a torch::save archive) run to ~11 kB.
    case "$name" in checkpoint_dir|torch_load|state_dict_file) max_len=16384 ;; *) max_len=4096 ;; esac
    LSAN_OPTIONS="suppressions=$ROOT/tests/fuzz/lsan.supp${LSAN_OPTIONS:+:$LSAN_OPTIONS}" \
    "$OUT/${name}_fuzz" -max_total_time="$seconds" -rss_limit_mb=2048 -malloc_limit_mb=64 \
      -max_len="$max_len" -artifact_prefix="$OUT/crash-$name-" -print_final_stats=1 "$OUT/corpus-$name"
  done
fi
