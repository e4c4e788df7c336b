// Fuzz harness for the checkpoint manifest parser (src/checkpoint/manifest.cpp): any text either
// parses into a manifest whose sections lie inside their files' stated sizes and whose pieces lie
// inside their sections, or throws shardopt::Error{Checkpoint}; any other exception, a crash or a
// sanitizer report is a finding. Replayed over corpus/manifest by CTest with the ordinary build.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "checkpoint/manifest.hpp"
#include "shardopt/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using shardopt::detail::Manifest;
  Manifest m;
  try {
    m = shardopt::detail::parse_manifest(std::string(reinterpret_cast<const char*>(data), size),
                                         "/nonexistent/fuzz-checkpoint");
  } catch (const shardopt::Error& e) {
    if (e.kind() != shardopt::ErrorKind::Checkpoint) std::abort();
    return 0;
  }
  // Note [Sizes from files]: what readers allocate is bounded by what the files state.
  for (const auto& f : m.files) {
    for (const auto& [name, s] : f.sections) {
      int64_t n = 1;
      for (int64_t d : s.shape) n *= d;  // checked by the parser: a wrap here is a UBSan report
      if (s.offset < 0 || n < 0 || n > f.bytes) std::abort();
    }
  }
  for (const auto& p : m.params) {
    for (const auto& piece : p.pieces) {
      if (piece.numel < 0 || piece.numel > p.numel || piece.shard_begin < 0) std::abort();
    }
  }
  if (const auto& s = m.loss_scaler;
      s && (!(s->scale > 0) || !std::isfinite(s->scale) || s->good_steps < 0 ||
            s->hysteresis_left < 0 || s->overflows < 0)) {
    std::abort();
  }
  return 0;
}
