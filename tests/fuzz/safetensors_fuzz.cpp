// libFuzzer harness for the safetensors reader (src/checkpoint/safetensors.cpp): any bytes either
// parse into entries that lie inside the data section, or throw std::runtime_error; never a
// crash, a sanitizer report or an allocation beyond the input. Built by tests/fuzz/build.sh with
// clang; replayed over corpus/safetensors by CTest with the ordinary build (replay_main.cpp).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>

#include "shardopt/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  shardopt::safetensors::File f;
  try {
    f = shardopt::safetensors::parse(reinterpret_cast<const char*>(data), size, "<fuzz input>");
  } catch (const std::runtime_error&) {
    return 0;
  }
  // What a consumer does next: read every entry's bytes (ASan sees any read past the data).
  unsigned sum = 0;
  for (const auto& e : f.entries) {
    if (e.offset > f.data.size() || e.nbytes > f.data.size() - e.offset) std::abort();
    for (size_t i = 0; i < e.nbytes; ++i) sum += static_cast<unsigned char>(f.bytes(e)[i]);
  }
  return static_cast<int>(sum & 0);
}
