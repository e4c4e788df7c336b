// Internals of the 8-bit AdamW kernels shared by their translation units: the maps' constants,
// the scalar quantiser and block (the reference every kernel equals), and the AVX-512 VBMI kernel
// (adam8bit_vbmi.cpp, Note [Fast 8-bit kernel] in adam8bit.hpp).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#include "kernels/adam8bit.hpp"

namespace shardopt::detail::kernels {

constexpr int kDecades = 7;

// Per-decade constants of one map, floats as the kernels use them.
struct MapConsts {
  float lower[kDecades];   // decade d starts at 10^(d-7) (d >= 1 counts thresholds passed)
  float scale[kDecades];   // 10^(6-d)
  float per_unit[kDecades];  // n_d / 0.9
  float below_mid[kDecades];  // midpoint to the code below decade d's first (zero for d = 0)
  int32_t base[kDecades];  // magnitude index of decade d's first code
  int32_t last[kDecades];  // n_d - 1
  float top_mid;           // midpoint between the largest code and 1.0
  std::array<float, 256> values;
};
const MapConsts& map_consts(bool is_signed);

inline uint8_t quantize_scalar(const MapConsts& c, float y, bool is_signed) {
  const float a = std::fabs(y);
  int d = 0;
  for (int i = 1; i < kDecades; ++i) d += a >= c.lower[i] ? 1 : 0;
  const float t = (a * c.scale[d] - 0.1f) * c.per_unit[d];
  const int k = std::min(std::max(static_cast<int>(std::floor(t)), 0), c.last[d]);
  const int mag = c.base[d] + k - (a < c.below_mid[d] ? 1 : 0);
  const bool top = a > c.top_mid;
  if (!is_signed) return static_cast<uint8_t>(mag + (top ? 1 : 0));
  if (y < 0) return static_cast<uint8_t>(mag > 0 ? (0x80 | mag) : 0);
  return static_cast<uint8_t>(top ? 0x80 : mag);
}

inline float reciprocal(float absmax) { return absmax > 0 ? 1.0f / absmax : 0.0f; }

// One block of n <= kQuantBlock elements at offset 0 of the pointers.
void block_scalar(const Adam8bitCoeffs& c, float* p, const float* g, uint8_t* q1, uint8_t* q2,
                  float* absmax1, float* absmax2, int64_t n);

#if defined(SHARDOPT_KERNELS_X86)
// Blocks [b0, b1) of the segment; call only where the CPU has AVX-512 F/BW/VL/DQ/CD and VBMI.
void blocks_vbmi(const Adam8bitCoeffs& c, const Adam8bitSegment& s, int64_t b0, int64_t b1);
// quantize_scalar over n finite values of (-2, 2), likewise.
void quantize_vbmi(const float* y, uint8_t* out, int64_t n, bool is_signed);
#endif

}  // namespace shardopt::detail::kernels
