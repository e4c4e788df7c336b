// MemoryTracker: allocator-level accounting of live CPU tensor storage (bytes and peak), by a
// c10::Allocator that wraps the CPU allocator in place when installed. Torch-free header.
//
//   shardopt::ScopedMemoryTracking tracking;          // installs; restores the allocator on exit
//   auto& t = shardopt::MemoryTracker::cpu();
//   t.reset_peak();
//   ... at::empty(...), opt.step(), ...
//   t.live_bytes(); t.peak_bytes();
//
// Note [What the tracker counts]
// Every byte requested from the CPU allocator while the tracker is installed counts as live until
// its storage is freed, whether the free happens before or after uninstalling (the process-wide
// tracker is never destroyed, so late frees still find it). Storage allocated before installation
// is freed through its own, original deleter and never touches the counts. Views, from_blob
// tensors and memory that does not come from the c10 CPU allocator (MPI/Gloo internals, BLAS
// workspaces, malloc in third-party code) are not counted: this is tensor storage, not RSS.
//
// Note [Memory cap]
// set_limit(bytes) makes the tracker refuse, as a device allocator would, any allocation that
// would take live_bytes() over the cap: it throws Error{OutOfMemory} naming the rank, the request,
// the cap and what is live, and nothing is allocated. The check and the count are one atomic step,
// so concurrent allocations cannot pass the cap together. A cap applies only while installed.
#pragma once

#include <cstdint>

namespace shardopt {

class MemoryTracker {
 public:
  // The process-wide tracker of CPU tensor storage (created on first use, never destroyed).
  static MemoryTracker& cpu();

  // Bytes of storage allocated through the tracker and not yet freed.
  int64_t live_bytes() const;
  // The highest live_bytes() since installation or the last reset_peak().
  int64_t peak_bytes() const;
  // Allocations through the tracker not yet freed, and ever made.
  int64_t live_allocations() const;
  int64_t total_allocations() const;
  // Starts a new peak window at the current live bytes; returns the previous peak.
  int64_t reset_peak();
  // The cap on live_bytes() (Note [Memory cap]); 0 (the default) means none.
  void set_limit(int64_t bytes);
  int64_t limit() const;

  // Makes the tracker the CPU allocator (c10::SetAllocator), wrapping the one in place. Nested
  // calls are counted; the wrapped allocator comes back with the last uninstall(). Call it before
  // other threads allocate (c10 allows changing allocators only at such quiet points).
  void install();
  void uninstall();
  bool installed() const;

  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

 private:
  MemoryTracker() = default;
  int depth_ = 0;
};

// Installs MemoryTracker::cpu() for the lifetime of the object; its peak window starts here.
class ScopedMemoryTracking {
 public:
  ScopedMemoryTracking();
  ~ScopedMemoryTracking();
  ScopedMemoryTracking(const ScopedMemoryTracking&) = delete;
  ScopedMemoryTracking& operator=(const ScopedMemoryTracking&) = delete;
  MemoryTracker& tracker() const { return MemoryTracker::cpu(); }
};

}  // namespace shardopt
