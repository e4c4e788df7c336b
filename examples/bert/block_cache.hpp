// BlockCache: a CPU allocator that keeps freed large blocks for the next allocation of the same
// size, so the per-step activations and gradients of a training loop (the same shapes every step)
// reuse memory that is already mapped instead of page-faulting it in again.
//
// Note [Why the trainer caches blocks]
// glibc serves blocks above its mmap threshold (at most 32 MiB) with fresh mmap()s and returns
// them on free(); the first touch of every 4 KiB page then costs a fault (~1.2 GB/s,
// docs/design.md).
// BERT with MLM logits at all positions allocates four 125 MB [tokens x vocab] tensors per step:
// 1M faults and ~20% of the step's CPU time. Freed blocks of at least min_bytes wait in the cache
// for the next allocation of their size class (sizes round up to 1/16 of their power of two, so
// shapes that vary a little from step to step still meet). What the cache may add to the resident
// memory is bounded twice: by max_cached_bytes (oldest dropped first) and by next_step(), called
// once per training step, which drops the blocks that waited a whole step without being reused
// (one-off shapes), so only the shapes every step needs stay. The trainer caches only blocks of
// 32 MiB and more: smaller ones glibc keeps in its heap and reuses for any size, which costs less
// resident memory than classes that only serve their own size (measured: with 1 MiB, the
// masked-positions BERT's peak RSS grew by ~130 MB and its step time did not fall).
#pragma once

#include <cstdint>

namespace bert {

struct BlockCacheStats {
  int64_t hits = 0;          // allocations served from the cache
  int64_t misses = 0;        // allocations of cacheable size that went to the wrapped allocator
  int64_t cached_bytes = 0;  // free blocks held now
  int64_t peak_cached_bytes = 0;
  int64_t dropped_unused = 0;  // dropped by next_step() after a step without reuse
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
  // Call once per training step: blocks freed before the previous call and not reused since go
  // back to the system.
  void next_step();
};

}  // namespace bert
