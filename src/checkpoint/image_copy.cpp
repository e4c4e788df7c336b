// The shard image's one-pass copy (image_copy.hpp; Note [Shard images] in shard_image.hpp).
#include "checkpoint/image_copy.hpp"

#include "checkpoint/crc32c.hpp"
#include "checkpoint/element_sums.hpp"
#include "checkpoint/files.hpp"
#include "kernels/finite.hpp"

#if defined(SHARDOPT_KERNELS_X86)
#include <immintrin.h>
#endif

namespace shardopt::detail {
namespace {

constexpr int64_t kBlock = kBlockBytes;
static_assert(kBlock % 64 == 0, "a block is whole 64-byte lines");

SummedCopy separate_passes(void* dst, const void* src, int64_t blocks, uint32_t* crcs,
                           uint64_t index) {
  crc32c_blocks(dst, src, blocks, kBlock, crcs);
  const int64_t numel = blocks * kBlock / 4;
  SummedCopy out;
  out.sum = consecutive_element_sum_u32(ElementHash::Multiply, index, numel,
                                        static_cast<const unsigned char*>(src));
  kernels::CheckSegment segment;
  segment.kind = kernels::ValueKind::Float32;
  segment.data = const_cast<void*>(src);
  segment.numel = numel;
  out.non_finite = kernels::raw::check_finite(kernels::CpuIsa::Auto, segment, {}).non_finite;
  return out;
}

#if defined(SHARDOPT_KERNELS_X86)
// Streams of `Streams` consecutive blocks, 64 bytes of each per step: a prefetch of the same
// bytes kPrefetchGroups groups ahead, one load, eight crc32 over the same bytes from L1 (three
// streams cover the instruction's latency of three cycles at one a cycle), x * 0 added into the
// check's accumulator, the hash of the 16 elements (the even ones in the low halves of the 64-bit
// lanes, the odd ones shifted down, each (bits ^ a) * b by vpmuludq, which reads only the low
// halves), then the non-temporal stores. a and b are the top halves of the Weyl sequences
// index * A and index * B (Note [Element checksums]), kept per stream and parity, advanced by
// adds. 660 MB on the Zen 4 build machine, alone: four streams without prefetches 0.072 s, three
// 0.057 s, three with them 0.048 s, a memcpy 0.057-0.063 s; with a second process copying beside
// it, all of them at the memory's rate (0.065-0.08 s).
constexpr int64_t kPrefetchGroups = 2;

template <int Streams>
__attribute__((target("avx512f,sse4.2"))) void blocks_avx512(uint8_t* dst, const uint8_t* src,
                                                             uint64_t index, uint32_t* crcs,
                                                             __m512i& acc, __m512& check) {
  const __m512i one = _mm512_set1_epi64(1);
  const __m512 zero = _mm512_setzero_ps();
  const __m512i step_a = _mm512_set1_epi64(static_cast<int64_t>(16 * kMultiplyA));
  const __m512i step_b = _mm512_set1_epi64(static_cast<int64_t>(16 * kMultiplyB));
  __m512i wa[Streams][2], wb[Streams][2];
  uint64_t crc[Streams];
  for (int k = 0; k < Streams; ++k) {
    const uint64_t first = index + static_cast<uint64_t>(k) * (kBlock / 4);
    for (int parity = 0; parity < 2; ++parity) {
      alignas(64) uint64_t la[8], lb[8];
      for (uint64_t l = 0; l < 8; ++l) {
        la[l] = (first + 2 * l + static_cast<uint64_t>(parity)) * kMultiplyA;
        lb[l] = (first + 2 * l + static_cast<uint64_t>(parity)) * kMultiplyB;
      }
      wa[k][parity] = _mm512_load_si512(la);
      wb[k][parity] = _mm512_load_si512(lb);
    }
    crc[k] = ~0u;
  }
  for (int64_t j = 0; j < kBlock; j += 64) {
    __m512i x[Streams];
    for (int k = 0; k < Streams; ++k) {
      const uint8_t* f = src + k * kBlock + j;
      _mm_prefetch(reinterpret_cast<const char*>(f) + kPrefetchGroups * Streams * kBlock,
                   _MM_HINT_T0);
      x[k] = _mm512_loadu_si512(f);
      for (int w = 0; w < 64; w += 8) {
        uint64_t word;
        __builtin_memcpy(&word, f + w, 8);
        crc[k] = _mm_crc32_u64(crc[k], word);
      }
      check = _mm512_fmadd_ps(_mm512_castsi512_ps(x[k]), zero, check);
      // Even elements: a in the low halves. Odd ones: x ^ (index * A) leaves bits ^ a in the
      // high halves, which the shift brings down.
      const __m512i even = _mm512_xor_si512(x[k], _mm512_srli_epi64(wa[k][0], 32));
      const __m512i odd = _mm512_srli_epi64(_mm512_xor_si512(x[k], wa[k][1]), 32);
      const __m512i b0 = _mm512_or_si512(_mm512_srli_epi64(wb[k][0], 32), one);
      const __m512i b1 = _mm512_or_si512(_mm512_srli_epi64(wb[k][1], 32), one);
      acc = _mm512_add_epi64(acc, _mm512_mul_epu32(even, b0));
      acc = _mm512_add_epi64(acc, _mm512_mul_epu32(odd, b1));
      wa[k][0] = _mm512_add_epi64(wa[k][0], step_a);
      wa[k][1] = _mm512_add_epi64(wa[k][1], step_a);
      wb[k][0] = _mm512_add_epi64(wb[k][0], step_b);
      wb[k][1] = _mm512_add_epi64(wb[k][1], step_b);
    }
    // The stores after every stream's loads: a load issued after a store to an address 4 KiB
    // apart (the blocks' offsets in source and image agree modulo 4 KiB) waits on it as if they
    // overlapped ("4K aliasing"); in that order this copy took 2x a memcpy.
    for (int k = 0; k < Streams; ++k) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + k * kBlock + j), x[k]);
    }
  }
  for (int k = 0; k < Streams; ++k) crcs[k] = ~static_cast<uint32_t>(crc[k]);
}

__attribute__((target("avx512f,sse4.2"))) SummedCopy one_pass(void* dst, const void* src,
                                                              int64_t blocks, uint32_t* crcs,
                                                              uint64_t index) {
  auto* to = static_cast<uint8_t*>(dst);
  const auto* from = static_cast<const uint8_t*>(src);
  __m512i acc = _mm512_setzero_si512();
  __m512 check = _mm512_setzero_ps();
  const auto per_block = static_cast<uint64_t>(kBlock / 4);
  int64_t b = 0;
  for (; b + 3 <= blocks; b += 3) {
    blocks_avx512<3>(to + b * kBlock, from + b * kBlock,
                     index + static_cast<uint64_t>(b) * per_block, crcs + b, acc, check);
  }
  for (; b < blocks; ++b) {
    blocks_avx512<1>(to + b * kBlock, from + b * kBlock,
                     index + static_cast<uint64_t>(b) * per_block, crcs + b, acc, check);
  }
  _mm_sfence();  // the streamed stores ordered before anyone reads them
  SummedCopy out;
  out.sum = static_cast<uint64_t>(_mm512_reduce_add_epi64(acc));
  out.non_finite = _mm512_cmp_ps_mask(check, check, _CMP_UNORD_Q) != 0;
  return out;
}

bool has_one_pass() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

}  // namespace

SummedCopy copy_blocks_summed(void* dst, const void* src, int64_t blocks, uint32_t* crcs,
                              uint64_t index) {
  if (blocks <= 0) return {};
#if defined(SHARDOPT_KERNELS_X86)
  if (has_one_pass()) return one_pass(dst, src, blocks, crcs, index);
#endif
  return separate_passes(dst, src, blocks, crcs, index);
}

}  // namespace shardopt::detail
