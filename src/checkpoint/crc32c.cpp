// CRC-32C (Note [CRC-32C] in crc32c.hpp): the SSE4.2 instruction over four streams, the portable
// table where it is missing, and the combination of pieces' CRCs.
#include "checkpoint/crc32c.hpp"

#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#include <nmmintrin.h>
#endif

namespace shardopt::detail {

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected

struct Table {
  uint32_t v[256];
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      v[i] = c;
    }
  }
};

uint32_t crc_bytes_portable(uint32_t c, const uint8_t* p, int64_t n) {
  static const Table table;
  for (int64_t i = 0; i < n; ++i) c = table.v[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c;
}

bool has_sse42() {
#if defined(__x86_64__)
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
#else
  return false;
#endif
}

void quarters_portable(const uint8_t* p, int64_t q, int64_t n, uint32_t c[4]) {
  for (int k = 0; k < 4; ++k) {
    const int64_t len = k < 3 ? q : n - 3 * q;
    c[k] = crc_bytes_portable(c[k], p + k * q, len);
  }
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc_bytes_sse42(uint32_t c32, const uint8_t* p,
                                                           int64_t n) {
  uint64_t c = c32;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    c = _mm_crc32_u64(c, w);
  }
  c32 = static_cast<uint32_t>(c);
  for (; i < n; ++i) c32 = _mm_crc32_u8(c32, p[i]);
  return c32;
}

__attribute__((target("sse4.2"))) void quarters_sse42(const uint8_t* p, int64_t q, int64_t n,
                                                      uint32_t c[4]) {
  uint64_t s[4] = {c[0], c[1], c[2], c[3]};
  const uint8_t* at[4] = {p, p + q, p + 2 * q, p + 3 * q};
  int64_t i = 0;
  for (; i + 8 <= q; i += 8) {  // four streams: the instruction's latency hidden
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, at[k] + i, 8);
      s[k] = _mm_crc32_u64(s[k], w);
    }
  }
  for (int k = 0; k < 4; ++k) {
    const int64_t len = k < 3 ? q : n - 3 * q;
    c[k] = crc_bytes_sse42(static_cast<uint32_t>(s[k]), at[k] + i, len - i);
  }
}
#endif

uint32_t crc_bytes(uint32_t c, const uint8_t* p, int64_t n) {
#if defined(__x86_64__)
  if (has_sse42()) return crc_bytes_sse42(c, p, n);
#endif
  return crc_bytes_portable(c, p, n);
}

void quarters(const uint8_t* p, int64_t n, uint32_t c[4]) {
  const int64_t q = n / 4 / 8 * 8;
#if defined(__x86_64__)
  if (has_sse42()) return quarters_sse42(p, q, n, c);
#endif
  quarters_portable(p, q, n, c);
}

// a * b modulo the polynomial, bit-reflected (x^0 is the top bit).
uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(2^k) modulo the polynomial, k = 0..31.
struct PowersOfX {
  uint32_t v[32];
  PowersOfX() {
    uint32_t p = 1u << 30;  // x^1
    v[0] = p;
    for (int k = 1; k < 32; ++k) v[k] = p = multmodp(p, p);
  }
};

// x^(8 n) modulo the polynomial: multiplying a register by it feeds it n zero bytes.
uint32_t x8n(int64_t n) {
  static const PowersOfX powers;
  uint32_t p = 1u << 31;  // x^0
  for (unsigned k = 3; n != 0; n >>= 1, ++k) {
    if (n & 1) p = multmodp(powers.v[k & 31], p);
  }
  return p;
}

// Copies n bytes while computing their register from 0: four lanes of kLane bytes at a time keep
// the instruction's latency hidden, so the pass runs at the memory's speed.
constexpr int64_t kLane = 16 << 10;

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t copy_crc_sse42(uint8_t* dst, const uint8_t* src,
                                                          int64_t n) {
  static const uint32_t lane_shift = x8n(kLane);
  uint32_t crc = 0;
  int64_t i = 0;
  for (; i + 4 * kLane <= n; i += 4 * kLane) {
    uint64_t s[4] = {0, 0, 0, 0};
    const uint8_t* from = src + i;
    uint8_t* to = dst + i;
    for (int64_t j = 0; j < kLane; j += 8) {
      for (int k = 0; k < 4; ++k) {
        uint64_t w;
        std::memcpy(&w, from + k * kLane + j, 8);
        s[k] = _mm_crc32_u64(s[k], w);
        std::memcpy(to + k * kLane + j, &w, 8);
      }
    }
    for (int k = 0; k < 4; ++k) crc = multmodp(lane_shift, crc) ^ static_cast<uint32_t>(s[k]);
  }
  uint64_t c = crc;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, src + i, 8);
    c = _mm_crc32_u64(c, w);
    std::memcpy(dst + i, &w, 8);
  }
  auto c32 = static_cast<uint32_t>(c);
  for (; i < n; ++i) {
    dst[i] = src[i];
    c32 = _mm_crc32_u8(c32, src[i]);
  }
  return c32;
}

// Four blocks at a time, one stream each; 64 bytes of a lane per step: four 16-byte loads and
// eight crc32 over the same bytes from L1, then their stores (non-temporal when `stream`).
template <bool Copy, bool Stream>
__attribute__((target("sse4.2"))) void blocks_sse42(uint8_t* dst, const uint8_t* src,
                                                    int64_t blocks, int64_t bb, uint32_t* crcs) {
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) {
    uint64_t s[4] = {~0u, ~0u, ~0u, ~0u};
    const uint8_t* from = src + b * bb;
    uint8_t* to = Copy ? dst + b * bb : nullptr;
    for (int64_t j = 0; j < bb; j += 64) {
      __m128i x[4][4];
      for (int k = 0; k < 4; ++k) {
        const uint8_t* f = from + k * bb + j;
        if constexpr (Copy) {
          for (int v = 0; v < 4; ++v) {
            x[k][v] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(f) + v);
          }
        }
        for (int w8 = 0; w8 < 64; w8 += 8) {
          uint64_t w;
          std::memcpy(&w, f + w8, 8);
          s[k] = _mm_crc32_u64(s[k], w);
        }
      }
      // Every stream's loads before the stores: source and copy agree modulo 4 KiB, and a load
      // after a store 4 KiB apart waits on it ("4K aliasing": 1.6x the time in the other order).
      for (int k = 0; Copy && k < 4; ++k) {
        auto* t = reinterpret_cast<__m128i*>(to + k * bb + j);
        for (int v = 0; v < 4; ++v) {
          if constexpr (Stream) {
            _mm_stream_si128(t + v, x[k][v]);
          } else {
            _mm_storeu_si128(t + v, x[k][v]);
          }
        }
      }
    }
    for (int k = 0; k < 4; ++k) crcs[b + k] = ~static_cast<uint32_t>(s[k]);
  }
  for (; b < blocks; ++b) {
    if constexpr (Copy) std::memcpy(dst + b * bb, src + b * bb, static_cast<size_t>(bb));
    crcs[b] = ~crc_bytes_sse42(~0u, src + b * bb, bb);
  }
  if constexpr (Stream) _mm_sfence();  // the streamed stores ordered before anyone reads them
}
#endif

}  // namespace

uint32_t crc32c_register(const void* data, int64_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  if (n < 256) return crc_bytes(0, p, n);
  uint32_t c[4] = {0, 0, 0, 0};
  const int64_t q = n / 4 / 8 * 8;
  quarters(p, n, c);
  const int64_t last = n - 3 * q;
  return crc32c_combine(crc32c_combine(crc32c_combine(c[0], c[1], q), c[2], q), c[3], last);
}

uint32_t crc32c_combine(uint32_t a, uint32_t b, int64_t b_bytes) {
  return multmodp(x8n(b_bytes), a) ^ b;
}

uint32_t crc32c_extend(uint32_t crc, const void* data, int64_t n) {
  if (n < 256) return ~crc_bytes(~crc, static_cast<const uint8_t*>(data), n);
  return ~crc32c_combine(~crc, crc32c_register(data, n), n);
}

uint32_t crc32c(const void* data, int64_t n) { return crc32c_extend(0, data, n); }

std::array<uint32_t, 4> crc32c_quarters(const void* data, int64_t n) {
  uint32_t c[4] = {~0u, ~0u, ~0u, ~0u};
  quarters(static_cast<const uint8_t*>(data), n, c);
  return {~c[0], ~c[1], ~c[2], ~c[3]};
}

uint32_t crc32c_copy_register(void* dst, const void* src, int64_t n) {
  auto* to = static_cast<uint8_t*>(dst);
  const auto* from = static_cast<const uint8_t*>(src);
#if defined(__x86_64__)
  if (has_sse42()) return copy_crc_sse42(to, from, n);
#endif
  std::memcpy(to, from, static_cast<size_t>(n));
  return crc_bytes_portable(0, to, n);
}

void crc32c_blocks(void* dst, const void* src, int64_t blocks, int64_t block_bytes,
                   uint32_t* crcs) {
  auto* to = static_cast<uint8_t*>(dst);
  const auto* from = static_cast<const uint8_t*>(src);
#if defined(__x86_64__)
  if (has_sse42() && block_bytes % 64 == 0) {
    if (to == nullptr) return blocks_sse42<false, false>(to, from, blocks, block_bytes, crcs);
    if (reinterpret_cast<uintptr_t>(to) % 16 == 0) {
      return blocks_sse42<true, true>(to, from, blocks, block_bytes, crcs);
    }
    return blocks_sse42<true, false>(to, from, blocks, block_bytes, crcs);
  }
#endif
  for (int64_t b = 0; b < blocks; ++b) {
    if (to != nullptr) std::memcpy(to + b * block_bytes, from + b * block_bytes,
                                   static_cast<size_t>(block_bytes));
    crcs[b] = ~crc_bytes_portable(~0u, from + b * block_bytes, block_bytes);
  }
}

Crc32cShift::Crc32cShift(int64_t b_bytes) {
  const uint32_t x = x8n(b_bytes);
  for (int k = 0; k < 4; ++k) {
    for (uint32_t v = 0; v < 256; ++v) t_[k][v] = multmodp(x, v << (8 * k));
  }
}

}  // namespace shardopt::detail
