// CRC-32C (Castagnoli): the checksum of in-memory snapshots (snapshot_slot.hpp) and of version-2
// checkpoint shard files (Note [Block checksums] in files.hpp). Torch-free; internal to
// src/checkpoint/.
//
// Note [CRC-32C]
// The SSE4.2 crc32 instruction computes CRC-32C at the memory's speed when four independent
// streams hide its latency (about 20 GB/s a core), where a table-driven CRC-32 such as Debian's
// zlib (no PCLMUL path) manages about 1 GB/s; the portable loop gives the same values where SSE4.2
// is missing. CRC is linear, so pieces are checksummed apart and combined: the CRC of A then B is
// A's multiplied by x^(8|B|) modulo the polynomial, xor B's. Here a "register" is the CRC state
// over bytes from 0 (neither pre- nor post-inverted: pieces combine by that rule alone), a "CRC"
// the standard, inverted value (combined by the same rule, as zlib's crc32_combine does).
#pragma once

#include <array>
#include <cstdint>

namespace shardopt::detail {

// The standard CRC-32C of [data, data + n).
uint32_t crc32c(const void* data, int64_t n);
// The CRC-32C of A then [data, data + n), from A's CRC-32C `crc` (crc32c(nullptr, 0) for none).
uint32_t crc32c_extend(uint32_t crc, const void* data, int64_t n);
// CRC-32C of each quarter of [data, data + n) (the last takes the remainder).
std::array<uint32_t, 4> crc32c_quarters(const void* data, int64_t n);
// Of A then B from A's and B's (CRCs or registers alike), B being `b_bytes` long.
uint32_t crc32c_combine(uint32_t a, uint32_t b, int64_t b_bytes);

// The register over [data, data + n) from 0.
uint32_t crc32c_register(const void* data, int64_t n);
// Copies n bytes from src to dst and returns their register from 0, from the registers the bytes
// were loaded into (one pass).
uint32_t crc32c_copy_register(void* dst, const void* src, int64_t n);

// The CRC-32C of each `block_bytes` block (a multiple of 64) of [src, src + blocks * block_bytes)
// into crcs[0, blocks), four blocks at a time; with dst, the bytes are also copied there in the
// same pass, by non-temporal stores when dst is 16-byte aligned (the copy is not read back soon:
// a checkpoint snapshot goes to the disk by DMA).
void crc32c_blocks(void* dst, const void* src, int64_t blocks, int64_t block_bytes,
                   uint32_t* crcs);

// crc32c_combine for one b_bytes used many times: the multiplication by x^(8 b_bytes), linear
// over GF(2), tabulated per byte (four lookups).
class Crc32cShift {
 public:
  explicit Crc32cShift(int64_t b_bytes);
  uint32_t combine(uint32_t a, uint32_t b) const {
    return t_[0][a & 0xFF] ^ t_[1][(a >> 8) & 0xFF] ^ t_[2][(a >> 16) & 0xFF] ^ t_[3][a >> 24] ^ b;
  }

 private:
  uint32_t t_[4][256];
};

}  // namespace shardopt::detail
