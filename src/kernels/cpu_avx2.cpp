// AVX2 kernels (8 floats per vector). Compiled with -mavx2 -mfma -mf16c -ffp-contract=off and
// only called after cpu_isa_supported(CpuIsa::Avx2) said yes.
#include <immintrin.h>

#include "kernels/cpu_kernels_impl.hpp"

namespace shardopt::detail::kernels {
namespace {

struct Avx2Isa {
  static constexpr int kWidth = 8;
  using F = __m256;
  struct Acc {
    __m256d lo, hi;
  };
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F div_by_const(F a, float, double inv_c) {
    const __m256d inv = _mm256_set1_pd(inv_c);
    const __m128 lo =
        _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(a)), inv));
    const __m128 hi =
        _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)), inv));
    return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
  }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F max(F a, F b) {
    return _mm256_or_ps(_mm256_max_ps(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
  }
  static void store_bf16(uint16_t* dst, F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
  }
  static void store_fp16(uint16_t* dst, F x) {
    __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i nan32 = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m128i nan16 =
        _mm_packs_epi32(_mm256_castsi256_si128(nan32), _mm256_extracti128_si256(nan32, 1));
    const __m128i canonical = _mm_or_si128(
        _mm_and_si128(h, _mm_set1_epi16(static_cast<int16_t>(0x8000))), _mm_set1_epi16(0x7E00));
    h = _mm_blendv_epi8(h, canonical, nan16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), h);
  }
  static F load_bf16(const uint16_t* src) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  static F load_fp16(const uint16_t* src) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  }
  static bool any_nan(F x) { return _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0; }
  static Acc acc_zero() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  static void acc_sq(Acc& acc, F x) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    acc.lo = _mm256_fmadd_pd(lo, lo, acc.lo);  // the square is exact in double
    acc.hi = _mm256_fmadd_pd(hi, hi, acc.hi);
  }
  static double acc_sum(const Acc& acc) {
    alignas(32) double t[4];
    _mm256_store_pd(t, _mm256_add_pd(acc.lo, acc.hi));
    return (t[0] + t[1]) + (t[2] + t[3]);
  }
};

}  // namespace

const CpuKernelTable kAvx2Kernels = make_table<Avx2Isa>();

}  // namespace shardopt::detail::kernels
