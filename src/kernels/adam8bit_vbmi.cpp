// 8-bit AdamW on AVX-512 VBMI (Note [Fast 8-bit kernel] in adam8bit.hpp): the codes' floats from
// byte planes, the quantiser by regions; bit for bit block_scalar. Compiled with -ffp-contract=off
// like the other kernels; the instruction sets by function attribute, picked at run time.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kernels/adam8bit_impl.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail::kernels {
namespace {

// The quantiser by regions: region 0 is below the first code's midpoint, 1 + d is decade d from
// its below_mid (where quantize_scalar's "- 1" stops), 8 is above top_mid. Inside a region the
// byte is base + min(floor(t), last) with quantize_scalar's t, so no decade search, no "- 1" and no
// top test; the region is the one where the float's binade starts, plus one when the binade
// holds a region boundary (never more than one: they are a decade apart).
struct RegionMap {
  float scale[16] = {}, per_unit[16] = {};  // zero in regions 0 and 8: t = 0
  int32_t base[32] = {}, last[16] = {};     // base[16 + r]: the byte's base for y < 0
  int32_t region0[32] = {}, bound[32] = {};  // by binade (exponent - 103, saturated)
  alignas(64) uint8_t planes[4][256] = {};   // byte b of the map's value of each code
};

uint32_t float_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

RegionMap make_region_map(bool is_signed) {
  const MapConsts& c = map_consts(is_signed);
  RegionMap r;
  constexpr int kRegions = kDecades + 2;
  uint32_t start[kRegions] = {};  // bits of each region's first float
  for (int d = 0; d < kDecades; ++d) {
    r.scale[1 + d] = c.scale[d];
    r.per_unit[1 + d] = c.per_unit[d];
    r.base[1 + d] = c.base[d];
    r.last[1 + d] = c.last[d];
    start[1 + d] = float_bits(c.below_mid[d]);
  }
  r.base[kRegions - 1] = is_signed ? 0x80 : 0xFF;
  // y < 0 (signed map): 0x80 | the magnitude's byte, 0 for zero, 0xFF above top_mid (the last
  // code, as quantize_scalar keeps -1.0 out of the map).
  for (int k = 1; k < kRegions; ++k) r.base[16 + k] = k == kRegions - 1 ? 0xFF : 0x80 | r.base[k];
  start[kRegions - 1] = float_bits(c.top_mid) + 1;  // the first float above top_mid
  for (int i = 0; i < 32; ++i) {  // binade i: [2^(i - 24), 2^(i - 23)); binade 0 from zero
    const uint32_t lo = i == 0 ? 0u : static_cast<uint32_t>(103 + i) << 23;
    const uint32_t hi = static_cast<uint32_t>(104 + i) << 23;
    int inside = 0;
    r.bound[i] = 0x7FFFFFFF;
    for (int k = 1; k < kRegions; ++k) {
      if (start[k] <= lo) r.region0[i] = k;
      if (start[k] > lo && start[k] < hi) r.bound[i] = static_cast<int32_t>(start[k]), ++inside;
    }
    SHARDOPT_CHECK(inside <= 1, Internal, "kernels: adam8bit: binade {} holds {} region bounds", i,
                   inside);
  }
  for (int b = 0; b < 4; ++b) {
    for (int q = 0; q < 256; ++q) {
      r.planes[b][q] = static_cast<uint8_t>(float_bits(c.values[q]) >> (8 * b));
    }
  }
  return r;
}

const RegionMap& region_map(bool is_signed) {
  static const RegionMap s = make_region_map(true), u = make_region_map(false);
  return is_signed ? s : u;
}

// The second pass of block_scalar on the moments a block kept (m, v as block_scalar computes them).
void quantize_block_scalar(const float* m, const float* v, float r1, float r2, uint8_t* q1,
                           uint8_t* q2, int64_t n) {
  const MapConsts& s = map_consts(true);
  const MapConsts& u = map_consts(false);
  for (int64_t i = 0; i < n; ++i) {
    q1[i] = quantize_scalar(s, m[i] * r1, true);
    q2[i] = quantize_scalar(u, v[i] * r2, false);
  }
}

#define SHARDOPT_AVX512_VBMI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512cd,avx512vbmi")))

struct VecRegions {
  __m512 scale, per_unit;
  __m512i base, base_neg, last, region0_lo, region0_hi, bound_lo, bound_hi;
};

SHARDOPT_AVX512_VBMI VecRegions vec_regions(const RegionMap& r) {
  return {_mm512_loadu_ps(r.scale),          _mm512_loadu_ps(r.per_unit),
          _mm512_loadu_si512(r.base),        _mm512_loadu_si512(r.base + 16),
          _mm512_loadu_si512(r.last),
          _mm512_loadu_si512(r.region0),     _mm512_loadu_si512(r.region0 + 16),
          _mm512_loadu_si512(r.bound),       _mm512_loadu_si512(r.bound + 16)};
}

// quantize_scalar for 16 finite y with |y| < 2, by regions; the byte in each 32-bit lane.
template <bool kSigned>
SHARDOPT_AVX512_VBMI inline __m512i quantize_regions16(const VecRegions& v, __m512 y) {
  const __m512 a = kSigned ? _mm512_abs_ps(y) : y;  // second moments are >= +0
  const __m512i ab = _mm512_castps_si512(a);
  const __m512i binade = _mm512_subs_epu16(_mm512_srli_epi32(ab, 23), _mm512_set1_epi32(103));
  __m512i reg = _mm512_permutex2var_epi32(v.region0_lo, binade, v.region0_hi);
  const __m512i bound = _mm512_permutex2var_epi32(v.bound_lo, binade, v.bound_hi);
  reg = _mm512_mask_add_epi32(reg, _mm512_cmpge_epi32_mask(ab, bound), reg, _mm512_set1_epi32(1));
  const __m512 t = _mm512_mul_ps(
      _mm512_sub_ps(_mm512_mul_ps(a, _mm512_permutexvar_ps(reg, v.scale)), _mm512_set1_ps(0.1f)),
      _mm512_permutexvar_ps(reg, v.per_unit));
  __m512i k = _mm512_cvt_roundps_epi32(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  k = _mm512_min_epi32(k, _mm512_permutexvar_epi32(reg, v.last));
  if constexpr (kSigned) {  // y < 0 (sign bit: -0 stays 0): the base from the second half
    reg = _mm512_mask_or_epi32(reg, _mm512_movepi32_mask(_mm512_castps_si512(y)), reg,
                               _mm512_set1_epi32(16));
    return _mm512_add_epi32(k, _mm512_permutex2var_epi32(v.base, reg, v.base_neg));
  }
  return _mm512_add_epi32(k, _mm512_permutexvar_epi32(reg, v.base));
}

// Bytes of elements 0..63 from four vectors of 16 (packus interleaves 128-bit lanes: the
// dword transpose puts them back in order; it is its own inverse, dequantize64 uses it too).
SHARDOPT_AVX512_VBMI inline __m512i transpose_dwords() {
  return _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
}
SHARDOPT_AVX512_VBMI inline __m512i pack64(const __m512i q[4]) {
  const __m512i w = _mm512_packus_epi16(_mm512_packus_epi32(q[0], q[1]),
                                        _mm512_packus_epi32(q[2], q[3]));
  return _mm512_permutexvar_epi32(transpose_dwords(), w);
}

// The map's values of 64 codes by table: each of the float's four bytes from a 256-byte plane
// (two 128-byte lookups, picked by the code's top bit), interleaved back into floats. The signed
// map needs half the lookups: 0x80 | j holds -value(j), except 0x80 itself (+1.0).
template <bool kSigned>
SHARDOPT_AVX512_VBMI inline void dequantize64(const RegionMap& r, __m512i codes, __m512 out[4]) {
  const __m512i x = _mm512_permutexvar_epi32(transpose_dwords(), codes);
  __m512i b[4];
  if constexpr (kSigned) {
    for (int p = 0; p < 4; ++p) {  // vpermi2b reads the index's low 7 bits
      b[p] = _mm512_permutex2var_epi8(_mm512_load_si512(r.planes[p]), x,
                                      _mm512_load_si512(r.planes[p] + 64));
    }
    const __m512i c80 = _mm512_set1_epi8(static_cast<char>(0x80));
    b[3] = _mm512_ternarylogic_epi32(b[3], x, c80, 0xF8);  // b | (x & 0x80): the sign
    const __mmask64 one = _mm512_cmpeq_epi8_mask(x, c80);
    b[2] = _mm512_mask_mov_epi8(b[2], one, c80);  // 1.0f = 0x3F800000
    b[3] = _mm512_mask_mov_epi8(b[3], one, _mm512_set1_epi8(0x3F));
  } else {
    const __mmask64 high = _mm512_movepi8_mask(x);
    for (int p = 0; p < 4; ++p) {
      const uint8_t* t = r.planes[p];
      const __m512i lo =
          _mm512_permutex2var_epi8(_mm512_load_si512(t), x, _mm512_load_si512(t + 64));
      const __m512i hi =
          _mm512_permutex2var_epi8(_mm512_load_si512(t + 128), x, _mm512_load_si512(t + 192));
      b[p] = _mm512_mask_mov_epi8(lo, high, hi);
    }
  }
  const __m512i l01 = _mm512_unpacklo_epi8(b[0], b[1]), h01 = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i l23 = _mm512_unpacklo_epi8(b[2], b[3]), h23 = _mm512_unpackhi_epi8(b[2], b[3]);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(l01, l23));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(l01, l23));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(h01, h23));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(h01, h23));
}

// One whole block (kQuantBlock elements): block_scalar's float operations, 16 lanes at a time.
SHARDOPT_AVX512_VBMI void block_vbmi(const Adam8bitCoeffs& c, const VecRegions& vs,
                                     const VecRegions& vu, float* p, const float* g, uint8_t* q1,
                                     uint8_t* q2, float* absmax1, float* absmax2) {
  alignas(64) float m[kQuantBlock], v[kQuantBlock];
  const RegionMap& rs = region_map(true);
  const RegionMap& ru = region_map(false);
  const float a1s = *absmax1, a2s = *absmax2;
  const __m512 a1 = _mm512_set1_ps(a1s), a2 = _mm512_set1_ps(a2s);
  const __m512 b1 = _mm512_set1_ps(c.beta1), omb1 = _mm512_set1_ps(c.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(c.beta2), omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 isbc2 = _mm512_set1_ps(c.inv_sqrt_bc2), eps = _mm512_set1_ps(c.eps);
  const __m512 decay = _mm512_set1_ps(c.decay), nss = _mm512_set1_ps(c.neg_step_size);
  const __m512 zero = _mm512_setzero_ps();
  __m512 max1 = zero, max2 = zero, nonfinite = zero;
  for (int64_t i0 = 0; i0 < kQuantBlock; i0 += 64) {
    __m512 d1[4], d2[4];
    dequantize64<true>(rs, _mm512_loadu_si512(q1 + i0), d1);
    dequantize64<false>(ru, _mm512_loadu_si512(q2 + i0), d2);
    for (int j = 0; j < 4; ++j) {
      const int64_t i = i0 + 16 * j;
      const __m512 gi = _mm512_loadu_ps(g + i);
      const __m512 mi = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(d1[j], a1), b1),
                                      _mm512_mul_ps(gi, omb1));
      const __m512 vi = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(d2[j], a2), b2),
                                      _mm512_mul_ps(_mm512_mul_ps(gi, gi), omb2));
      const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi), isbc2), eps);
      __m512 pi = _mm512_loadu_ps(p + i);
      pi = _mm512_add_ps(_mm512_mul_ps(pi, decay), _mm512_div_ps(_mm512_mul_ps(nss, mi), denom));
      _mm512_storeu_ps(p + i, pi);
      _mm512_store_ps(m + i, mi);
      _mm512_store_ps(v + i, vi);
      max1 = _mm512_max_ps(_mm512_abs_ps(mi), max1);  // NaN skipped, as std::max(max1, x)
      max2 = _mm512_max_ps(vi, max2);
      nonfinite = _mm512_fmadd_ps(vi, zero, nonfinite);  // NaN from a NaN or infinite v on
    }
  }
  const float mx1 = _mm512_reduce_max_ps(max1), mx2 = _mm512_reduce_max_ps(max2);
  const float r1 = reciprocal(mx1), r2 = reciprocal(mx2);
  *absmax1 = mx1;
  *absmax2 = mx2;
  // A finite v means a finite gradient, so a finite m unless the old maximum was not; then
  // |m * r1| <= 1 (1 + 2^-23) and v * r2 likewise, the region quantiser's domain.
  const bool regular = _mm512_cmp_ps_mask(nonfinite, nonfinite, _CMP_UNORD_Q) == 0 &&
                       std::isfinite(r1) && std::isfinite(r2) && std::isfinite(a1s) &&
                       std::isfinite(a2s);
  if (!regular) {
    quantize_block_scalar(m, v, r1, r2, q1, q2, kQuantBlock);
    return;
  }
  const __m512 vr1 = _mm512_set1_ps(r1), vr2 = _mm512_set1_ps(r2);
  for (int64_t i0 = 0; i0 < kQuantBlock; i0 += 64) {
    __m512i k1[4], k2[4];
    for (int j = 0; j < 4; ++j) {
      const int64_t i = i0 + 16 * j;
      k1[j] = quantize_regions16<true>(vs, _mm512_mul_ps(_mm512_load_ps(m + i), vr1));
      k2[j] = quantize_regions16<false>(vu, _mm512_mul_ps(_mm512_load_ps(v + i), vr2));
    }
    _mm512_storeu_si512(q1 + i0, pack64(k1));
    _mm512_storeu_si512(q2 + i0, pack64(k2));
  }
}

}  // namespace

SHARDOPT_AVX512_VBMI void blocks_vbmi(const Adam8bitCoeffs& c, const Adam8bitSegment& s,
                                      int64_t b0, int64_t b1) {
  const VecRegions vs = vec_regions(region_map(true)), vu = vec_regions(region_map(false));
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t at = b * kQuantBlock;
    if (s.numel - at >= kQuantBlock) {
      block_vbmi(c, vs, vu, s.param + at, s.grad + at, s.state1 + at, s.state2 + at,
                 s.absmax1 + b, s.absmax2 + b);
    } else {  // the short last block
      block_scalar(c, s.param + at, s.grad + at, s.state1 + at, s.state2 + at, s.absmax1 + b,
                   s.absmax2 + b, s.numel - at);
    }
  }
}

SHARDOPT_AVX512_VBMI void quantize_vbmi(const float* y, uint8_t* out, int64_t n, bool is_signed) {
  const VecRegions vr = vec_regions(region_map(is_signed));
  int64_t i0 = 0;
  for (; i0 + 64 <= n; i0 += 64) {
    __m512i q[4];
    for (int j = 0; j < 4; ++j) {
      const __m512 yj = _mm512_loadu_ps(y + i0 + 16 * j);
      q[j] = is_signed ? quantize_regions16<true>(vr, yj) : quantize_regions16<false>(vr, yj);
    }
    _mm512_storeu_si512(out + i0, pack64(q));
  }
  for (; i0 < n; ++i0) out[i0] = quantize_scalar(map_consts(is_signed), y[i0], is_signed);
}

}  // namespace shardopt::detail::kernels
