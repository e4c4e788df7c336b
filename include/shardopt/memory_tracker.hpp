/// \file
/// MemoryTracker: allocator-level accounting of live CPU tensor storage (bytes and peak), by a
/// c10::Allocator that wraps the CPU allocator in place when installed. Torch-free header.
///
///   shardopt::ScopedMemoryTracking tracking;          // installs; restores the allocator on exit
///   auto& t = shardopt::MemoryTracker::cpu();
///   t.reset_peak();
///   ... at::empty(...), opt.step(), ...
///   t.live_bytes(); t.peak_bytes();
///
/// Note [What the tracker counts]
/// Every byte requested from the CPU allocator while the tracker is installed counts as live until
/// its storage is freed, whether the free happens before or after uninstalling (the process-wide
/// tracker is never destroyed, so late frees still find it). Storage allocated before installation
/// is freed through its own, original deleter and never touches the counts. Views, from_blob
/// tensors and memory that does not come from the c10 CPU allocator (MPI/Gloo internals, BLAS
/// workspaces, malloc in third-party code) are not counted: this is tensor storage, not RSS.
///
/// Note [Memory cap]
/// set_limit(bytes) makes the tracker refuse, as a device allocator would, any allocation that
/// would take live_bytes() over the cap: it throws Error{OutOfMemory} naming the rank, the request,
/// the cap and what is live, and nothing is allocated. The check and the count are one atomic step,
/// so concurrent allocations cannot pass the cap together. A cap applies only while installed.
///
/// Note [Peak attribution]
/// Each tracked allocation carries the (category, owner) of the MemoryScope open on its thread
/// when it was made (none: "other", which is activations saved for backward, autograd's
/// temporaries and the user's tensors). The tracker keeps live bytes per (category, owner) and,
/// whenever live_bytes() reaches a new peak, a copy of them: peak_report() says where the bytes
/// were at the peak, as torch's memory snapshot does for CUDA. shardopt's optimizer opens scopes
/// where it allocates: "parameter shards", "persistent parameters", "gathered parts" (owner: the
/// part), "gradients", "gradient buckets", "optimizer state", "step temporaries".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardopt {

/// Tracked bytes by category and owner at one moment (Note [Peak attribution]).
struct MemoryPeakReport {
  /// One (category, owner) pair's bytes.
  struct Entry {
    std::string category;  ///< what kind of memory ("optimizer state", "bucket", ...)
    std::string owner;  ///< which piece or parameter holds it
    int64_t bytes = 0;  ///< bytes at the peak
  };
  int64_t peak_bytes = 0;      ///< MemoryTracker::peak_bytes() when it was taken
  std::vector<Entry> entries;  ///< non-zero ones, largest first; they sum to peak_bytes
  int64_t bytes_of(const std::string& category) const;  ///< summed over owners
  std::string to_string() const;  ///< one line per entry, in MB (10^6 bytes)
};

/// Allocator-level accounting of live CPU tensor storage (see the file's comment); one per process.
class MemoryTracker {
 public:
  /// The process-wide tracker of CPU tensor storage (created on first use, never destroyed).
  static MemoryTracker& cpu();

  /// Bytes of storage allocated through the tracker and not yet freed.
  int64_t live_bytes() const;
  /// The highest live_bytes() since installation or the last reset_peak().
  int64_t peak_bytes() const;
  /// Allocations through the tracker not yet freed, and ever made.
  int64_t live_allocations() const;
  int64_t total_allocations() const;  ///< allocations ever made through the tracker
  /// Starts a new peak window at the current live bytes; returns the previous peak.
  int64_t reset_peak();
  /// Where the tracked bytes were at the peak of this window (Note [Peak attribution]).
  MemoryPeakReport peak_report() const;
  /// The cap on live_bytes() (Note [Memory cap]); 0 (the default) means none.
  void set_limit(int64_t bytes);
  int64_t limit() const;  ///< the cap set by set_limit(); 0: none

  /// Makes the tracker the CPU allocator (c10::SetAllocator), wrapping the one in place. Nested
  /// calls are counted; the wrapped allocator comes back with the last uninstall(). Call it before
  /// other threads allocate (c10 allows changing allocators only at such quiet points).
  void install();
  void uninstall();  ///< Puts the wrapped allocator back once every install() has been undone.
  bool installed() const;  ///< whether the tracker is the CPU allocator now

  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

 private:
  MemoryTracker() = default;
  int depth_ = 0;
};

/// Allocations this thread makes while the scope is open are attributed to (category, owner)
/// (Note [Peak attribution]); scopes nest, the innermost wins. Cheap: a thread-local index.
class MemoryScope {
 public:
  /// Attributes this thread's allocations to (category, owner) until the scope closes.
  MemoryScope(const char* category, const std::string& owner) : MemoryScope(tag(category, owner)) {}
  /// A tag from tag(): what a hot path keeps instead of the strings.
  explicit MemoryScope(int tag);
  ~MemoryScope();
  /// The tag of (category, owner), registered on first use.
  static int tag(const char* category, const std::string& owner);
  MemoryScope(const MemoryScope&) = delete;
  MemoryScope& operator=(const MemoryScope&) = delete;

 private:
  int previous_ = 0;
};

/// Installs MemoryTracker::cpu() for the lifetime of the object; its peak window starts here.
class ScopedMemoryTracking {
 public:
  ScopedMemoryTracking();
  ~ScopedMemoryTracking();
  ScopedMemoryTracking(const ScopedMemoryTracking&) = delete;
  ScopedMemoryTracking& operator=(const ScopedMemoryTracking&) = delete;
  MemoryTracker& tracker() const { return MemoryTracker::cpu(); }  ///< the tracker it installed
};

}  // namespace shardopt
