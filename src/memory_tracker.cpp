// The tracking CPU allocator behind MemoryTracker (see Note [What the tracker counts]).
//
// Note [Tracked pointers]
// A tracked DataPtr has data == context == the wrapped allocator's data pointer and one static
// deleter, so c10's raw_allocate/raw_deallocate keep working. The wrapped allocator's own DataPtr
// (whatever its context and deleter) is kept in a table keyed by that pointer and released from
// there, so the memory goes back exactly where it came from, also after uninstall().
#include "shardopt/memory_tracker.hpp"

#include <c10/core/Allocator.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "allocator_compat.hpp"
#include "shardopt/error.hpp"
#include "shardopt/threads.hpp"

namespace shardopt {
namespace {

// Higher than any registration's (those use 0); c10 keeps the highest priority seen, so the
// restore in uninstall() uses the same value.
constexpr uint8_t kPriority = 200;

struct Counters {
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> live_allocations{0};
  std::atomic<int64_t> total_allocations{0};
  std::atomic<int64_t> limit{0};  // 0: no cap

  // Counts `bytes` as live unless that would pass the cap; refuses (nothing counted) otherwise.
  void reserve(int64_t bytes) {
    const int64_t cap = limit.load(std::memory_order_relaxed);
    int64_t seen = live.load(std::memory_order_relaxed);
    while (true) {
      if (cap > 0 && seen + bytes > cap) refuse(bytes, seen, cap);
      if (live.compare_exchange_weak(seen, seen + bytes, std::memory_order_relaxed)) break;
    }
    note(seen + bytes);
  }
  void note(int64_t now) {
    int64_t high = peak.load(std::memory_order_relaxed);
    while (now > high && !peak.compare_exchange_weak(high, now, std::memory_order_relaxed)) {
    }
    live_allocations.fetch_add(1, std::memory_order_relaxed);
    total_allocations.fetch_add(1, std::memory_order_relaxed);
  }
  void unreserve(int64_t bytes) {
    live.fetch_sub(bytes, std::memory_order_relaxed);
    live_allocations.fetch_sub(1, std::memory_order_relaxed);
    total_allocations.fetch_sub(1, std::memory_order_relaxed);
  }
  void remove(int64_t bytes) {
    live.fetch_sub(bytes, std::memory_order_relaxed);
    live_allocations.fetch_sub(1, std::memory_order_relaxed);
  }

  // As a device allocator reports it: the request, the cap, what is live and what is left.
  [[noreturn]] void refuse(int64_t bytes, int64_t live_now, int64_t cap) const {
    constexpr double kMB = 1e6;
    SHARDOPT_FAIL(OutOfMemory,
                  "memory_tracker: out of memory: tried to allocate {:.1f} MB ({} bytes) with "
                  "{:.1f} MB of tensor storage live in {} allocations, over the per-rank cap of "
                  "{:.1f} MB ({} bytes; {:.1f} MB free under it)",
                  bytes / kMB, bytes, live_now / kMB,
                  live_allocations.load(std::memory_order_relaxed), cap / kMB, cap,
                  (cap - live_now) / kMB);
  }
};

struct Record {
  int64_t bytes;
  c10::DataPtr inner;
  int tag = 0;
};

// Note [Peak attribution]: the (category, owner) pairs, interned; tag 0 is "other".
struct Tags {
  std::mutex mutex;
  std::vector<std::pair<std::string, std::string>> names{{"other", ""}};
  std::map<std::pair<std::string, std::string>, int> index{{{"other", ""}, 0}};
};
Tags& tags() {
  static auto* t = new Tags();  // never destroyed, like the allocator
  return *t;
}
thread_local int t_tag = 0;  // the innermost open MemoryScope's tag on this thread

// Live bytes per tag and their copy at the peak; guarded by the allocator's table mutex.
struct Attribution {
  std::vector<int64_t> live;
  int64_t live_total = 0;
  std::vector<int64_t> at_peak;
  int64_t peak_total = 0;
  void add(int tag, int64_t bytes) {
    if (static_cast<size_t>(tag) >= live.size()) live.resize(tag + 1, 0);
    live[tag] += bytes;
    live_total += bytes;
    if (live_total > peak_total) {
      at_peak = live;
      peak_total = live_total;
    }
  }
  void remove(int tag, int64_t bytes) {
    live[tag] -= bytes;
    live_total -= bytes;
  }
  void reset() {
    at_peak = live;
    peak_total = live_total;
  }
};

class TrackingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) SHARDOPT_ALLOCATE_CONST override {
    const auto bytes = static_cast<int64_t>(n);
    if (n > 0) counters_.reserve(bytes);
    c10::DataPtr inner;
    try {
      inner = inner_.load(std::memory_order_acquire)->allocate(n);
    } catch (...) {
      if (n > 0) counters_.unreserve(bytes);
      throw;
    }
    void* data = inner.get();
    const c10::Device device = inner.device();
    if (data != nullptr) {
      if (n == 0) counters_.note(counters_.live.load(std::memory_order_relaxed));
      std::lock_guard<std::mutex> lock(table_mutex_);
      table_.emplace(data, Record{bytes, std::move(inner), t_tag});
      attribution_.add(t_tag, bytes);
    } else if (n > 0) {
      counters_.unreserve(bytes);
    }
    return {data, data, &release, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

#if SHARDOPT_ALLOCATOR_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    inner_.load(std::memory_order_acquire)->copy_data(dest, src, count);
  }
#endif

  static TrackingAllocator& get() {
    static auto* allocator = new TrackingAllocator();  // never destroyed: late frees need it
    return *allocator;
  }

  void set_inner(c10::Allocator* inner) { inner_.store(inner, std::memory_order_release); }
  c10::Allocator* inner() const { return inner_.load(std::memory_order_acquire); }
  Counters& counters() { return counters_; }

  void reset_attribution() {
    std::lock_guard<std::mutex> lock(table_mutex_);
    attribution_.reset();
  }
  std::pair<std::vector<int64_t>, int64_t> attribution_at_peak() const {
    std::lock_guard<std::mutex> lock(table_mutex_);
    return {attribution_.at_peak, attribution_.peak_total};
  }

 private:
  static void release(void* data) {
    if (data == nullptr) return;
    auto& self = get();
    Record record{0, {}};
    {
      std::lock_guard<std::mutex> lock(self.table_mutex_);
      auto it = self.table_.find(data);
      if (it == self.table_.end()) return;  // not ours: cannot happen with our own DataPtrs
      record = std::move(it->second);
      self.table_.erase(it);
      self.attribution_.remove(record.tag, record.bytes);
    }
    self.counters_.remove(record.bytes);
    // record.inner frees the memory through the wrapped allocator's deleter on scope exit.
  }

  std::atomic<c10::Allocator*> inner_{nullptr};
  mutable std::mutex table_mutex_;
  mutable std::unordered_map<void*, Record> table_;
  mutable Counters counters_;
  mutable Attribution attribution_;  // guarded by table_mutex_
};

std::mutex& install_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

MemoryTracker& MemoryTracker::cpu() {
  static auto* tracker = new MemoryTracker();  // never destroyed, like its allocator
  return *tracker;
}

int64_t MemoryTracker::live_bytes() const {
  return TrackingAllocator::get().counters().live.load(std::memory_order_relaxed);
}
int64_t MemoryTracker::peak_bytes() const {
  return TrackingAllocator::get().counters().peak.load(std::memory_order_relaxed);
}
int64_t MemoryTracker::live_allocations() const {
  return TrackingAllocator::get().counters().live_allocations.load(std::memory_order_relaxed);
}
int64_t MemoryTracker::total_allocations() const {
  return TrackingAllocator::get().counters().total_allocations.load(std::memory_order_relaxed);
}
int64_t MemoryTracker::reset_peak() {
  auto& c = TrackingAllocator::get().counters();
  TrackingAllocator::get().reset_attribution();
  return c.peak.exchange(c.live.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

MemoryPeakReport MemoryTracker::peak_report() const {
  auto [at_peak, total] = TrackingAllocator::get().attribution_at_peak();
  MemoryPeakReport report;
  report.peak_bytes = total;
  {
    auto& t = tags();
    std::lock_guard<std::mutex> lock(t.mutex);
    for (size_t i = 0; i < at_peak.size(); ++i) {
      if (at_peak[i] != 0) {
        report.entries.push_back({t.names[i].first, t.names[i].second, at_peak[i]});
      }
    }
  }
  std::stable_sort(report.entries.begin(), report.entries.end(),
                   [](const auto& a, const auto& b) { return a.bytes > b.bytes; });
  return report;
}

int64_t MemoryPeakReport::bytes_of(const std::string& category) const {
  int64_t bytes = 0;
  for (const auto& e : entries) {
    if (e.category == category) bytes += e.bytes;
  }
  return bytes;
}

std::string MemoryPeakReport::to_string() const {
  std::string out = fmt::format("peak {:.3f} MB of tracked CPU tensor storage:\n", peak_bytes / 1e6);
  for (const auto& e : entries) {
    out += fmt::format("  {:>10.3f} MB  {}{}\n", e.bytes / 1e6, e.category,
                       e.owner.empty() ? std::string() : " (" + e.owner + ")");
  }
  return out;
}

int MemoryScope::tag(const char* category, const std::string& owner) {
  auto& t = tags();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto [it, fresh] = t.index.emplace(std::make_pair(std::string(category), owner),
                                     static_cast<int>(t.names.size()));
  if (fresh) t.names.emplace_back(category, owner);
  return it->second;
}

MemoryScope::MemoryScope(int tag) : previous_(t_tag) { t_tag = tag; }
MemoryScope::~MemoryScope() { t_tag = previous_; }

void MemoryTracker::set_limit(int64_t bytes) {
  SHARDOPT_CHECK(bytes >= 0, InvalidArgument,
                 "memory_tracker: the cap must be >= 0 bytes (0: none), got {}", bytes);
  TrackingAllocator::get().counters().limit.store(bytes, std::memory_order_relaxed);
}
int64_t MemoryTracker::limit() const {
  return TrackingAllocator::get().counters().limit.load(std::memory_order_relaxed);
}

void MemoryTracker::install() {
  // Note [Ranks that are threads] (src/error.cpp): the tracker counts the process, which under
  // the thread engine is every rank at once; a per-rank figure from it would be wrong.
  SHARDOPT_CHECK(thread_rank() < 0, Unsupported,
                 "memory_tracker: the tracker counts the whole process, and this is thread-rank "
                 "{} of the thread engine (run_ranks), whose ranks share the process; measure "
                 "memory with one process per rank (mpirun)",
                 thread_rank());
  std::lock_guard<std::mutex> lock(install_mutex());
  auto& tracking = TrackingAllocator::get();
  if (depth_++ > 0) return;
  c10::Allocator* current = c10::GetAllocator(c10::DeviceType::CPU);
  SHARDOPT_INTERNAL_ASSERT(current != &tracking, "the tracker is installed at depth 0");
  tracking.set_inner(current);
  c10::SetAllocator(c10::DeviceType::CPU, &tracking, kPriority);
  SHARDOPT_CHECK(c10::GetAllocator(c10::DeviceType::CPU) == &tracking, Unsupported,
                 "memory_tracker: the CPU allocator could not be replaced (another allocator "
                 "holds a priority above {})", kPriority);
  reset_peak();
}

void MemoryTracker::uninstall() {
  std::lock_guard<std::mutex> lock(install_mutex());
  SHARDOPT_CHECK(depth_ > 0, InvalidArgument,
                 "memory_tracker: uninstall() without a matching install()");
  if (--depth_ > 0) return;
  auto& tracking = TrackingAllocator::get();
  // Someone installed an allocator above ours: theirs stays, ours keeps serving it as its inner.
  if (c10::GetAllocator(c10::DeviceType::CPU) == &tracking) {
    c10::SetAllocator(c10::DeviceType::CPU, tracking.inner(), kPriority);
  }
}

bool MemoryTracker::installed() const {
  return c10::GetAllocator(c10::DeviceType::CPU) == &TrackingAllocator::get();
}

ScopedMemoryTracking::ScopedMemoryTracking() {
  MemoryTracker::cpu().install();
  MemoryTracker::cpu().reset_peak();
}
ScopedMemoryTracking::~ScopedMemoryTracking() { MemoryTracker::cpu().uninstall(); }

}  // namespace shardopt
