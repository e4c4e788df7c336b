// STREAM triad a = b + s*c, the reference bandwidth every CPU benchmark states next to its own
// rates (kernels_bench, step_bench). Chunked like the fused kernels (kChunkNumel per task of
// at::parallel_for) and compiled for the widest vectors this CPU has (function multi-versioning),
// so the reference is not held back by baseline SSE2 code.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

#include "kernels/fused.hpp"

namespace shardopt::bench {

constexpr double kTriadBytes = 12;  // STREAM's count: read b, c; write a

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
inline void triad_serial(float* __restrict a, const float* __restrict b,
                         const float* __restrict c, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

// One triad over n elements on at::get_num_threads() threads.
inline void triad(float* a, const float* b, const float* c, float s, int64_t n) {
  at::parallel_for(0, n, detail::kernels::kChunkNumel, [&](int64_t begin, int64_t end) {
    triad_serial(a + begin, b + begin, c + begin, s, end - begin);
  });
}

}  // namespace shardopt::bench
