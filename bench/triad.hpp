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

// The data movement of one AdamW step and nothing else (p += g, m += g, v += g: read four
// streams, write three, 28 B per element): the bound a fused AdamW kernel is measured against,
// counted the way the kernel is, with no read for ownership to argue about.
constexpr double kAdamStreamsBytes = 28;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
inline void adam_streams_serial(float* __restrict p, const float* __restrict g,
                                float* __restrict m, float* __restrict v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    p[i] += x;
    m[i] += x;
    v[i] += x;
  }
}

inline void adam_streams(float* p, const float* g, float* m, float* v, int64_t n) {
  at::parallel_for(0, n, detail::kernels::kChunkNumel, [&](int64_t begin, int64_t end) {
    adam_streams_serial(p + begin, g + begin, m + begin, v + begin, end - begin);
  });
}

// One triad over n elements on at::get_num_threads() threads.
inline void triad(float* a, const float* b, const float* c, float s, int64_t n) {
  at::parallel_for(0, n, detail::kernels::kChunkNumel, [&](int64_t begin, int64_t end) {
    triad_serial(a + begin, b + begin, c + begin, s, end - begin);
  });
}

}  // namespace shardopt::bench
