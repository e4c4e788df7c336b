// The element checksums' hot loop (Note [Element checksums] in element_sums.hpp): 4-byte elements
// at consecutive indices, eight hashes per AVX-512 step where the CPU has AVX-512DQ (its 64-bit
// multiply). The sum is modulo 2^64, so adding the lanes in any order gives the scalar loop's
// result bit for bit.
#include "checkpoint/element_sums.hpp"

#if defined(SHARDOPT_KERNELS_X86)
#include <immintrin.h>
#endif

namespace shardopt::detail {
namespace {

uint64_t consecutive_u32_scalar(ElementHash h, uint64_t begin, int64_t numel,
                                const unsigned char* bytes) {
  uint64_t sum = 0;
  for (int64_t j = 0; j < numel; ++j) {
    uint32_t bits;
    std::memcpy(&bits, bytes + 4 * j, 4);
    sum += element_hash(h, begin + static_cast<uint64_t>(j), bits);
  }
  return sum;
}

#if defined(SHARDOPT_KERNELS_X86)
__attribute__((target("avx512f,avx512dq"))) uint64_t consecutive_u32_avx512(
    uint64_t begin, int64_t numel, const unsigned char* bytes) {
  const __m512i c1 = _mm512_set1_epi64(static_cast<int64_t>(0x9E3779B97F4A7C15ull));
  const __m512i c2 = _mm512_set1_epi64(static_cast<int64_t>(0xD6E8FEB86659FD93ull));
  const __m512i c3 = _mm512_set1_epi64(static_cast<int64_t>(0x632BE59BD9B4E019ull));
  const __m512i c4 = _mm512_set1_epi64(static_cast<int64_t>(0xBF58476D1CE4E5B9ull));
  const __m512i c5 = _mm512_set1_epi64(static_cast<int64_t>(0x94D049BB133111EBull));
  // index * c1 advances by 8 * c1 per step: an add, not a multiply.
  __m512i scaled = _mm512_mullo_epi64(
      _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(begin)),
                       _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7)),
      c1);
  const __m512i stride = _mm512_mullo_epi64(_mm512_set1_epi64(8), c1);
  __m512i acc = _mm512_setzero_si512();
  int64_t j = 0;
  for (; j + 8 <= numel; j += 8) {
    const __m512i bits = _mm512_cvtepu32_epi64(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 4 * j)));
    __m512i z = _mm512_add_epi64(_mm512_add_epi64(scaled, _mm512_mullo_epi64(bits, c2)), c3);
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), c4);
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), c5);
    acc = _mm512_add_epi64(acc, _mm512_xor_si512(z, _mm512_srli_epi64(z, 31)));
    scaled = _mm512_add_epi64(scaled, stride);
  }
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(acc)) +
         consecutive_u32_scalar(ElementHash::Mix64, begin + static_cast<uint64_t>(j), numel - j,
                                bytes + 4 * j);
}

// ElementHash::Multiply: the Weyl sequences advance by adds, a and b are their top halves, and
// (bits ^ a) * b is vpmuludq's 32 x 32 -> 64-bit product (both operands below 2^32).
__attribute__((target("avx512f"))) uint64_t consecutive_u32_multiply_avx512(
    uint64_t begin, int64_t numel, const unsigned char* bytes) {
  // Lane l holds index (begin + j + l) times each constant: set once, then advanced by adds.
  alignas(64) uint64_t sa[8], sb[8];
  for (uint64_t l = 0; l < 8; ++l) {
    sa[l] = (begin + l) * kMultiplyA;
    sb[l] = (begin + l) * kMultiplyB;
  }
  __m512i wa = _mm512_load_si512(sa), wb = _mm512_load_si512(sb);
  const __m512i da = _mm512_set1_epi64(static_cast<int64_t>(8 * kMultiplyA));
  const __m512i db = _mm512_set1_epi64(static_cast<int64_t>(8 * kMultiplyB));
  const __m512i one = _mm512_set1_epi64(1);
  __m512i acc = _mm512_setzero_si512();
  int64_t j = 0;
  for (; j + 8 <= numel; j += 8) {
    const __m512i bits = _mm512_cvtepu32_epi64(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 4 * j)));
    const __m512i a = _mm512_srli_epi64(wa, 32);
    const __m512i b = _mm512_or_si512(_mm512_srli_epi64(wb, 32), one);
    acc = _mm512_add_epi64(acc, _mm512_mul_epu32(_mm512_xor_si512(bits, a), b));
    wa = _mm512_add_epi64(wa, da);
    wb = _mm512_add_epi64(wb, db);
  }
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(acc)) +
         consecutive_u32_scalar(ElementHash::Multiply, begin + static_cast<uint64_t>(j),
                                numel - j, bytes + 4 * j);
}

bool has_avx512dq() {
  static const bool yes =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return yes;
}

bool has_avx512f() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}
#endif

}  // namespace

uint64_t consecutive_element_sum_u32(ElementHash h, uint64_t begin, int64_t numel,
                                     const unsigned char* bytes) {
#if defined(SHARDOPT_KERNELS_X86)
  if (h == ElementHash::Mix64 && has_avx512dq()) return consecutive_u32_avx512(begin, numel, bytes);
  if (h == ElementHash::Multiply && has_avx512f()) {
    return consecutive_u32_multiply_avx512(begin, numel, bytes);
  }
#endif
  return consecutive_u32_scalar(h, begin, numel, bytes);
}

}  // namespace shardopt::detail
