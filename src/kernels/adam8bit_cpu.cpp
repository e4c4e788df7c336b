// 8-bit AdamW on the CPU: the dynamic maps, the scalar kernel (any CPU: the reference), the
// arithmetic AVX-512 one (function-level target, picked at run time where VBMI is missing; the
// VBMI kernel is adam8bit_vbmi.cpp), and the block-parallel driver.
// Compiled with -ffp-contract=off: both kernels perform the same float operations
// (Note [Dynamic 8-bit map] in adam8bit.hpp).
#include "kernels/adam8bit.hpp"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>

#if defined(SHARDOPT_KERNELS_X86)
#include <immintrin.h>
#endif

#include "kernels/adam8bit_impl.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail::kernels {
namespace {

// A code's exact value (the quantiser's midpoints are between exact values).
double code_value(int d, int k, int n) {
  return std::pow(10.0, d - 6) * (0.1 + (k + 0.5) * 0.9 / n);
}

// Per decade: the code spacing 0.9 / n_d and 10^(d-6), as floats (the kernels' dequantisation).
float code_width(int d, bool is_signed) {
  return static_cast<float>(0.9 / (is_signed ? (1 << d) : (2 << d)));
}
float decade_scale(int d) { return static_cast<float>(std::pow(10.0, d - 6)); }
// A code's value as the kernels compute it: three float operations (Note [Dynamic 8-bit map]).
float code_float(int d, int k, bool is_signed) {
  return (0.1f + (static_cast<float>(k) + 0.5f) * code_width(d, is_signed)) * decade_scale(d);
}

MapConsts make_map(bool is_signed) {
  MapConsts c{};
  int base = 1;
  double prev_last = 0.0;  // the code below decade d's first: zero, then the last of d - 1
  for (int d = 0; d < kDecades; ++d) {
    const int n = is_signed ? (1 << d) : (2 << d);
    c.lower[d] = static_cast<float>(std::pow(10.0, d - 7));
    c.scale[d] = static_cast<float>(std::pow(10.0, 6 - d));
    c.per_unit[d] = static_cast<float>(n / 0.9);
    c.below_mid[d] = static_cast<float>((prev_last + code_value(d, 0, n)) / 2);
    c.base[d] = base;
    c.last[d] = n - 1;
    for (int k = 0; k < n; ++k) {
      const float v = code_float(d, k, is_signed);
      c.values[base + k] = v;
      if (is_signed) c.values[0x80 | (base + k)] = -v;
    }
    prev_last = code_value(d, n - 1, n);
    base += n;
  }
  c.top_mid = static_cast<float>((prev_last + 1.0) / 2);
  c.values[0] = 0.0f;
  if (is_signed) {
    c.values[0x80] = 1.0f;  // bitsandbytes' signed map: +1.0, no -1.0
  } else {
    c.values[255] = 1.0f;
  }
  return c;
}

}  // namespace

const MapConsts& map_consts(bool is_signed) {
  static const MapConsts s = make_map(true), u = make_map(false);
  return is_signed ? s : u;
}

void block_scalar(const Adam8bitCoeffs& c, float* p, const float* g, uint8_t* q1, uint8_t* q2,
                  float* absmax1, float* absmax2, int64_t n) {
  const MapConsts& s = map_consts(true);
  const MapConsts& u = map_consts(false);
  float m[kQuantBlock], v[kQuantBlock];
  const float a1 = *absmax1, a2 = *absmax2;
  float max1 = 0.0f, max2 = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    m[i] = s.values[q1[i]] * a1 * c.beta1 + gi * c.one_minus_beta1;
    v[i] = u.values[q2[i]] * a2 * c.beta2 + gi * gi * c.one_minus_beta2;
    const float denom = std::sqrt(v[i]) * c.inv_sqrt_bc2 + c.eps;
    p[i] = p[i] * c.decay + c.neg_step_size * m[i] / denom;
    max1 = std::max(max1, std::fabs(m[i]));
    max2 = std::max(max2, v[i]);
  }
  const float r1 = reciprocal(max1), r2 = reciprocal(max2);
  for (int64_t i = 0; i < n; ++i) {
    q1[i] = quantize_scalar(s, m[i] * r1, true);
    q2[i] = quantize_scalar(u, v[i] * r2, false);
  }
  *absmax1 = max1;
  *absmax2 = max2;
}

namespace {

#if defined(SHARDOPT_KERNELS_X86)
#define SHARDOPT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512cd")))

struct VecMap {
  __m512 lower[kDecades], scale, per_unit, below_mid, top_mid;
  __m512i base, last;
  __m512 width, decade;  // code_width, decade_scale by decade (dequantisation)
};

SHARDOPT_AVX512 inline __m512 table16(const float* t) {
  alignas(64) float x[16] = {};
  std::copy(t, t + kDecades, x);
  return _mm512_load_ps(x);
}
SHARDOPT_AVX512 inline __m512i table16i(const int32_t* t) {
  alignas(64) int32_t x[16] = {};
  std::copy(t, t + kDecades, x);
  return _mm512_load_si512(x);
}

SHARDOPT_AVX512 VecMap vec_map(const MapConsts& c) {
  VecMap m;
  for (int i = 0; i < kDecades; ++i) m.lower[i] = _mm512_set1_ps(c.lower[i]);
  m.scale = table16(c.scale);
  m.per_unit = table16(c.per_unit);
  m.below_mid = table16(c.below_mid);
  m.top_mid = _mm512_set1_ps(c.top_mid);
  m.base = table16i(c.base);
  m.last = table16i(c.last);
  return m;
}

SHARDOPT_AVX512 void set_dequant(VecMap& m, bool is_signed) {
  float w[kDecades], s[kDecades];
  for (int d = 0; d < kDecades; ++d) w[d] = code_width(d, is_signed), s[d] = decade_scale(d);
  m.width = table16(w);
  m.decade = table16(s);
}

// The map's value of each code byte without a table: the decade of magnitude index j is the
// position of its highest bit (signed: j in [2^d, 2^(d+1)); unsigned: j + 1 in [2^(d+1),
// 2^(d+2))), then code_float's three operations; zero and 1.0 by comparison.
template <bool kSigned>
SHARDOPT_AVX512 inline __m512 dequantize16(const VecMap& c, __m512i b) {
  const __m512i one = _mm512_set1_epi32(1);
  __m512i j = kSigned ? _mm512_and_si512(b, _mm512_set1_epi32(0x7F)) : _mm512_add_epi32(b, one);
  const __m512i hi = _mm512_sub_epi32(_mm512_set1_epi32(31), _mm512_lzcnt_epi32(j));  // log2
  const __m512i d = kSigned ? hi : _mm512_sub_epi32(hi, one);
  const __m512i k = _mm512_sub_epi32(j, _mm512_sllv_epi32(one, hi));
  const __m512 kf = _mm512_add_ps(_mm512_cvtepi32_ps(k), _mm512_set1_ps(0.5f));
  __m512 v = _mm512_mul_ps(
      _mm512_add_ps(_mm512_set1_ps(0.1f), _mm512_mul_ps(kf, _mm512_permutexvar_ps(d, c.width))),
      _mm512_permutexvar_ps(d, c.decade));
  const __m512i zero = _mm512_setzero_si512();
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  if constexpr (kSigned) {
    v = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
    v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(j, zero), _mm512_setzero_ps());
    v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(b, _mm512_set1_epi32(0x80)),
                           _mm512_set1_ps(1.0f));
  } else {
    v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(b, zero), _mm512_setzero_ps());
    v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(b, _mm512_set1_epi32(255)),
                           _mm512_set1_ps(1.0f));
  }
  return v;
}

// The scalar quantize_scalar, 16 lanes: the same float operations.
template <bool kSigned>
SHARDOPT_AVX512 inline __m128i quantize16(const VecMap& c, __m512 y) {
  const __m512 a = _mm512_abs_ps(y);
  __m512i d = _mm512_setzero_si512();
  const __m512i one = _mm512_set1_epi32(1);
  for (int i = 1; i < kDecades; ++i) {
    d = _mm512_mask_add_epi32(d, _mm512_cmp_ps_mask(a, c.lower[i], _CMP_GE_OQ), d, one);
  }
  const __m512 t = _mm512_mul_ps(
      _mm512_sub_ps(_mm512_mul_ps(a, _mm512_permutexvar_ps(d, c.scale)), _mm512_set1_ps(0.1f)),
      _mm512_permutexvar_ps(d, c.per_unit));
  __m512i k =
      _mm512_cvtps_epi32(_mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
  k = _mm512_min_epi32(_mm512_max_epi32(k, _mm512_setzero_si512()),
                       _mm512_permutexvar_epi32(d, c.last));
  __m512i mag = _mm512_add_epi32(_mm512_permutexvar_epi32(d, c.base), k);
  mag = _mm512_mask_sub_epi32(
      mag, _mm512_cmp_ps_mask(a, _mm512_permutexvar_ps(d, c.below_mid), _CMP_LT_OQ), mag, one);
  const __mmask16 top = _mm512_cmp_ps_mask(a, c.top_mid, _CMP_GT_OQ);
  if constexpr (!kSigned) {
    mag = _mm512_mask_add_epi32(mag, top, mag, one);
  } else {
    const __mmask16 neg = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __mmask16 nonzero = _mm512_cmpgt_epi32_mask(mag, _mm512_setzero_si512());
    mag = _mm512_mask_or_epi32(mag, neg & nonzero, mag, _mm512_set1_epi32(0x80));
    mag = _mm512_mask_mov_epi32(mag, top & ~neg, _mm512_set1_epi32(0x80));
  }
  return _mm512_cvtepi32_epi8(mag);
}

SHARDOPT_AVX512 inline float hmax(__m512 x) { return _mm512_reduce_max_ps(x); }

SHARDOPT_AVX512 void block_avx512(const Adam8bitCoeffs& c, const VecMap& vs, const VecMap& vu,
                                  float* p, const float* g, uint8_t* q1, uint8_t* q2,
                                  float* absmax1, float* absmax2, int64_t n) {
  alignas(64) float m[kQuantBlock], v[kQuantBlock];
  const __m512 a1 = _mm512_set1_ps(*absmax1), a2 = _mm512_set1_ps(*absmax2);
  const __m512 b1 = _mm512_set1_ps(c.beta1), omb1 = _mm512_set1_ps(c.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(c.beta2), omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 isbc2 = _mm512_set1_ps(c.inv_sqrt_bc2), eps = _mm512_set1_ps(c.eps);
  const __m512 decay = _mm512_set1_ps(c.decay), nss = _mm512_set1_ps(c.neg_step_size);
  __m512 max1 = _mm512_setzero_ps(), max2 = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512i c1 = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, q1 + i));
    const __m512i c2 = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, q2 + i));
    const __m512 gi = _mm512_maskz_loadu_ps(k, g + i);
    const __m512 mo = _mm512_mul_ps(dequantize16<true>(vs, c1), a1);
    const __m512 vo = _mm512_mul_ps(dequantize16<false>(vu, c2), a2);
    const __m512 mi = _mm512_add_ps(_mm512_mul_ps(mo, b1), _mm512_mul_ps(gi, omb1));
    const __m512 vi =
        _mm512_add_ps(_mm512_mul_ps(vo, b2), _mm512_mul_ps(_mm512_mul_ps(gi, gi), omb2));
    const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi), isbc2), eps);
    __m512 pi = _mm512_maskz_loadu_ps(k, p + i);
    pi = _mm512_add_ps(_mm512_mul_ps(pi, decay), _mm512_div_ps(_mm512_mul_ps(nss, mi), denom));
    _mm512_mask_storeu_ps(p + i, k, pi);
    _mm512_store_ps(m + i, mi);  // masked-off lanes hold zeros (zero codes, gradients)
    _mm512_store_ps(v + i, vi);
    max1 = _mm512_max_ps(max1, _mm512_abs_ps(mi));
    max2 = _mm512_max_ps(max2, vi);
  }
  const float mx1 = hmax(max1), mx2 = hmax(max2);
  const __m512 r1 = _mm512_set1_ps(reciprocal(mx1)), r2 = _mm512_set1_ps(reciprocal(mx2));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 y1 = _mm512_mul_ps(_mm512_load_ps(m + i), r1);
    const __m512 y2 = _mm512_mul_ps(_mm512_load_ps(v + i), r2);
    _mm_mask_storeu_epi8(q1 + i, k, quantize16<true>(vs, y1));
    _mm_mask_storeu_epi8(q2 + i, k, quantize16<false>(vu, y2));
  }
  *absmax1 = mx1;
  *absmax2 = mx2;
}

SHARDOPT_AVX512 void blocks_avx512(const Adam8bitCoeffs& c, const Adam8bitSegment& s, int64_t b0,
                                   int64_t b1) {
  VecMap vs = vec_map(map_consts(true)), vu = vec_map(map_consts(false));
  set_dequant(vs, true);
  set_dequant(vu, false);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t at = b * kQuantBlock;
    block_avx512(c, vs, vu, s.param + at, s.grad + at, s.state1 + at, s.state2 + at,
                 s.absmax1 + b, s.absmax2 + b, std::min(kQuantBlock, s.numel - at));
  }
}
#endif

bool use_avx512(CpuIsa isa) {
  const CpuIsa resolved = resolve_cpu_isa(isa);
#if defined(SHARDOPT_KERNELS_X86)
  static const bool extra =
      __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq");
  return resolved == CpuIsa::Avx512 && extra;
#else
  return false;
#endif
}

std::atomic<bool> vbmi_allowed{true};  // allow_adam8bit_vbmi

// The byte-table kernel needs AVX-512 VBMI (vpermi2b) on top (Zen 4, Ice Lake and later).
bool use_vbmi(CpuIsa isa) {
#if defined(SHARDOPT_KERNELS_X86)
  static const bool vbmi = __builtin_cpu_supports("avx512vbmi");
  return vbmi && vbmi_allowed.load(std::memory_order_relaxed) && use_avx512(isa);
#else
  (void)isa;
  return false;
#endif
}

}  // namespace

const float* dynamic_map(bool is_signed) { return map_consts(is_signed).values.data(); }

uint8_t quantize_dynamic(float y, bool is_signed) {
  return quantize_scalar(map_consts(is_signed), y, is_signed);
}

void allow_adam8bit_vbmi(bool allowed) { vbmi_allowed.store(allowed); }

void quantize_dynamic_n(const float* y, uint8_t* out, int64_t n, bool is_signed, CpuIsa isa) {
#if defined(SHARDOPT_KERNELS_X86)
  if (use_vbmi(isa)) {
    for (int64_t i = 0; i < n; ++i) {  // the kernel's domain: its moments scaled by 1 / max
      SHARDOPT_CHECK(std::fabs(y[i]) < 2.0f && (is_signed || !std::signbit(y[i])), InvalidArgument,
                     "kernels: quantize_dynamic_n: y[{}] = {} is outside {}", i, y[i],
                     is_signed ? "(-2, 2)" : "[+0, 2)");
    }
    quantize_vbmi(y, out, n, is_signed);
    return;
  }
#endif
  (void)isa;
  for (int64_t i = 0; i < n; ++i) out[i] = quantize_dynamic(y[i], is_signed);
}

Adam8bitCoeffs adam8bit_coeffs(const Adam8bitHyper& h) {
  Adam8bitCoeffs c;
  const double step = static_cast<double>(h.step);
  c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(h.beta2, step)));
  c.eps = static_cast<float>(h.eps);
  c.neg_step_size = static_cast<float>(-h.lr / (1.0 - std::pow(h.beta1, step)));
  return c;
}

void fused_adam8bit(const Adam8bitHyper& hyper, const Adam8bitSegment& s, CpuIsa isa) {
  SHARDOPT_CHECK(s.numel >= 0, InvalidArgument, "kernels: adam8bit: negative numel {}", s.numel);
  if (s.numel == 0) return;
  SHARDOPT_CHECK(s.param && s.grad && s.state1 && s.state2 && s.absmax1 && s.absmax2,
                 InvalidArgument, "kernels: adam8bit: a buffer of {} elements is null", s.numel);
  const Adam8bitCoeffs c = adam8bit_coeffs(hyper);
  const int64_t blocks = (s.numel + kQuantBlock - 1) / kQuantBlock;
  const bool vec = use_avx512(isa), vbmi = use_vbmi(isa);
  constexpr int64_t kGrainBlocks = 64;
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
#if defined(SHARDOPT_KERNELS_X86)
    if (vbmi) {
      blocks_vbmi(c, s, b0, b1);
      return;
    }
    if (vec) {
      blocks_avx512(c, s, b0, b1);
      return;
    }
#endif
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t at = b * kQuantBlock;
      block_scalar(c, s.param + at, s.grad + at, s.state1 + at, s.state2 + at, s.absmax1 + b,
                   s.absmax2 + b, std::min(kQuantBlock, s.numel - at));
    }
  });
  (void)vec, (void)vbmi;
}

void adam8bit_fp32(const Adam8bitHyper& hyper, float* p, const float* g, float* m, float* v,
                   int64_t n) {
  const Adam8bitCoeffs c = adam8bit_coeffs(hyper);
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    m[i] = m[i] * c.beta1 + gi * c.one_minus_beta1;
    v[i] = v[i] * c.beta2 + gi * gi * c.one_minus_beta2;
    const float denom = std::sqrt(v[i]) * c.inv_sqrt_bc2 + c.eps;
    p[i] = p[i] * c.decay + c.neg_step_size * m[i] / denom;
  }
}

}  // namespace shardopt::detail::kernels
