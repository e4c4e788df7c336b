// BlockCache: a CPU allocator that keeps freed large blocks for the next allocation of the same
// size, so the per-step activations and gradients of a training loop (the same shapes every step)
// reuse memory that is already mapped instead of page-faulting it in again.
//
// Note [Why the trainer caches blocks]
// glibc serves blocks above its mmap threshold (at most 32 MiB) with fresh mmap()s and returns
// them on free(); the first touch of every 4 KiB page then costs a fault (~1.2 GB/s here, DESIGN.md).
// BERT with MLM logits at all positions allocates four 125 MB [tokens x vocab] tensors per step:
// 1M faults and ~20% of the step's CPU time. Freed blocks of at least min_bytes wait in the cache
// (at most max_cached_bytes of them, oldest dropped first) for an allocation of exactly their
// size. Exact sizes keep the peak resident memory at the peak of live storage plus the cached
// blocks of sizes not in use at that moment, bounded by max_cached_bytes.
#pragma once

#include <cstdint>

namespace bert {

struct BlockCacheStats {
  int64_t hits = 0;          // allocations served from the cache
  int64_t misses = 0;        // allocations of cacheable size that went to the wrapped allocator
  int64_t cached_bytes = 0;  // free blocks held now
  int64_t peak_cached_bytes = 0;
};

// Installs the cache as the CPU allocator (c10::SetAllocator) for the object's lifetime (one at a
// time; its statistics start at zero). Blocks
// allocated while installed go back through it whenever they are freed; install before the
// memory tracker (shardopt::ScopedMemoryTracking) so that cached blocks do not count as live.
class ScopedBlockCache {
 public:
  ScopedBlockCache(int64_t min_bytes, int64_t max_cached_bytes);
  ~ScopedBlockCache();
  ScopedBlockCache(const ScopedBlockCache&) = delete;
  ScopedBlockCache& operator=(const ScopedBlockCache&) = delete;
  BlockCacheStats stats() const;
};

}  // namespace bert
