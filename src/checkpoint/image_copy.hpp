// The shard image's one-pass copy of whole blocks (Note [Shard images] in shard_image.hpp): the
// bytes, their block CRC-32Cs (Note [CRC-32C]), the element sums' hash (ElementHash::Multiply,
// Note [Element checksums]) and the fp32 non-finite check (Note [Exact non-finite check]) from one
// read of the source. Torch-free; internal to src/checkpoint/.
#pragma once

#include <cstdint>

namespace shardopt::detail {

struct SummedCopy {
  uint64_t sum = 0;         // of multiply_hash(index + j, element j) over the copied elements
  bool non_finite = false;  // some element, read as fp32, is NaN or +-Inf
};

// Copies `blocks` blocks of kBlockBytes (files.hpp) of 4-byte elements from `src` to `dst`
// (64-byte aligned; non-temporal stores: the image goes to the disk by DMA, not back through the
// cache), writes each block's CRC-32C to crcs[0, blocks), and returns the sum of the elements'
// hashes at consecutive indices from `index` and the fp32 check. On AVX-512F with SSE4.2 that is
// one pass whose arithmetic hides under the memory's time; elsewhere the three separate passes
// (crc32c_blocks, consecutive_element_sum_u32, the non-finite kernel), the same results.
SummedCopy copy_blocks_summed(void* dst, const void* src, int64_t blocks, uint32_t* crcs,
                              uint64_t index);

}  // namespace shardopt::detail
