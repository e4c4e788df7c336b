// AVX-512 kernels (16 floats per vector). Compiled with -mavx512f -mavx512bw -mavx512vl (plus the
// AVX2 flags) and -ffp-contract=off; only called after cpu_isa_supported(CpuIsa::Avx512).
#include <immintrin.h>

#include "kernels/cpu_kernels_impl.hpp"

namespace shardopt::detail::kernels {
namespace {

struct Avx512Isa {
  static constexpr int kWidth = 16;
  using F = __m512;
  struct Acc {
    __m512d lo, hi;
  };
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F div_by_const(F a, float, double inv_c) {
    const __m512d inv = _mm512_set1_pd(inv_c);
    const __m256 lo =
        _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(a)), inv));
    const __m256 hi = _mm512_cvtpd_ps(_mm512_mul_pd(
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))), inv));
    return _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
  }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F max(F a, F b) {
    const __mmask16 unordered = _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(unordered, _mm512_max_ps(a, b),
                                _mm512_castsi512_ps(_mm512_set1_epi32(-1)));
  }
  static void store_bf16(uint16_t* dst, F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r,
                                _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
  }
  static void store_fp16(uint16_t* dst, F x) {
    __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i canonical =
        _mm256_or_si256(_mm256_and_si256(h, _mm256_set1_epi16(static_cast<int16_t>(0x8000))),
                        _mm256_set1_epi16(0x7E00));
    h = _mm256_mask_blend_epi16(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), h, canonical);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
  }
  static F load_bf16(const uint16_t* src) {
    const __m512i u =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  }
  static F load_fp16(const uint16_t* src) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  }
  static bool any_nan(F x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) != 0; }
  static Acc acc_zero() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
  static void acc_sq(Acc& acc, F x) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi =
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    acc.lo = _mm512_fmadd_pd(lo, lo, acc.lo);  // the square is exact in double
    acc.hi = _mm512_fmadd_pd(hi, hi, acc.hi);
  }
  static double acc_sum(const Acc& acc) {
    alignas(64) double t[8];
    _mm512_store_pd(t, _mm512_add_pd(acc.lo, acc.hi));
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
  }
};

}  // namespace

const CpuKernelTable kAvx512Kernels = make_table<Avx512Isa>();

}  // namespace shardopt::detail::kernels
