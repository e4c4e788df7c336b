// The exact-size block cache behind ScopedBlockCache (see Note [Why the trainer caches blocks]).
// Every block it hands out has data == context and one static deleter; the wrapped allocator's
// own DataPtr is kept in a table and released from there (as shardopt's memory tracker does).
#include "block_cache.hpp"

#include <c10/core/Allocator.h>
#if __has_include(<torch/version.h>)
#include <torch/version.h>
#endif

#include <algorithm>
#include <list>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(TORCH_VERSION_MAJOR) && \
    (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3))
#define BERT_ALLOCATE_CONST
#define BERT_ALLOCATOR_HAS_COPY_DATA 1
#else
#define BERT_ALLOCATE_CONST const
#define BERT_ALLOCATOR_HAS_COPY_DATA 0
#endif

namespace bert {
namespace {

constexpr uint8_t kPriority = 200;  // as shardopt's tracker: above every registration

class CachingAllocator final : public c10::Allocator {
 public:
  static CachingAllocator& get() {
    static auto* self = new CachingAllocator();  // never destroyed: late frees need it
    return *self;
  }

  c10::DataPtr allocate(size_t requested) BERT_ALLOCATE_CONST override {
    auto& self = const_cast<CachingAllocator&>(*this);
    c10::DataPtr block;
    if (requested == 0) return {nullptr, nullptr, &release, c10::Device(c10::DeviceType::CPU)};
    size_t n = requested;
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      if (self.enabled_ && static_cast<int64_t>(n) >= self.min_bytes_) {
        n = size_class(n);
        auto it = self.by_size_.find(n);
        if (it != self.by_size_.end() && !it->second.empty()) {
          auto entry = it->second.back();
          it->second.pop_back();
          block = std::move(entry->block);
          self.lru_.erase(entry);
          self.stats_.cached_bytes -= static_cast<int64_t>(n);
          ++self.stats_.hits;
        } else {
          ++self.stats_.misses;
        }
      }
    }
    if (!block) block = self.inner_->allocate(n);
    void* data = block.get();
    const c10::Device device = block.device();
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      self.live_.emplace(data, Live{n, std::move(block)});
    }
    return {data, data, &release, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

#if BERT_ALLOCATOR_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    inner_->copy_data(dest, src, count);
  }
#endif

  // Cacheable sizes round up to 1/16 of their power of two (under 6.25% more), so that tensors
  // whose shapes vary a little from step to step (the masked positions of a batch) share blocks.
  static size_t size_class(size_t n) {
    size_t pow2 = 4096;
    while (pow2 * 2 <= n) pow2 *= 2;
    const size_t granule = std::max<size_t>(4096, pow2 / 16);
    return (n + granule - 1) / granule * granule;
  }

  // Drops the blocks that waited a whole step without being reused.
  void next_step() {
    std::list<Entry> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++epoch_;
      while (!lru_.empty() && lru_.front().epoch + 1 < epoch_) {
        auto oldest = lru_.begin();
        auto& same = by_size_[oldest->bytes];
        same.erase(std::find(same.begin(), same.end(), oldest));
        stats_.cached_bytes -= static_cast<int64_t>(oldest->bytes);
        ++stats_.dropped_unused;
        dropped.splice(dropped.end(), lru_, oldest);
      }
    }
  }

  void install(int64_t min_bytes, int64_t max_cached_bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (enabled_) throw std::logic_error("ScopedBlockCache: already installed");
    c10::Allocator* current = c10::GetAllocator(c10::DeviceType::CPU);
    if (current != this) inner_ = current;
    min_bytes_ = std::max<int64_t>(1, min_bytes);
    max_cached_bytes_ = max_cached_bytes;
    stats_ = BlockCacheStats{};
    enabled_ = true;
    c10::SetAllocator(c10::DeviceType::CPU, this, kPriority);
  }

  void uninstall() {
    std::list<Entry> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      enabled_ = false;
      if (c10::GetAllocator(c10::DeviceType::CPU) == this) {
        c10::SetAllocator(c10::DeviceType::CPU, inner_, kPriority);
      }
      dropped.swap(lru_);
      by_size_.clear();
      stats_.cached_bytes = 0;
    }
    // `dropped` frees the cached blocks through the wrapped allocator here, outside the lock.
  }

  BlockCacheStats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

 private:
  struct Entry {
    size_t bytes;
    c10::DataPtr block;
    int64_t epoch;  // the step in which it was freed
  };
  struct Live {
    size_t bytes;
    c10::DataPtr block;
  };

  static void release(void* data) {
    if (data == nullptr) return;
    auto& self = get();
    c10::DataPtr block;
    std::list<Entry> evicted;
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto it = self.live_.find(data);
      if (it == self.live_.end()) return;
      const size_t n = it->second.bytes;
      block = std::move(it->second.block);
      self.live_.erase(it);
      const auto bytes = static_cast<int64_t>(n);
      if (self.enabled_ && bytes >= self.min_bytes_ && bytes <= self.max_cached_bytes_) {
        // Oldest blocks make room first.
        while (self.stats_.cached_bytes + bytes > self.max_cached_bytes_) {
          auto oldest = self.lru_.begin();
          auto& same = self.by_size_[oldest->bytes];
          same.erase(std::find(same.begin(), same.end(), oldest));
          self.stats_.cached_bytes -= static_cast<int64_t>(oldest->bytes);
          evicted.splice(evicted.end(), self.lru_, oldest);
        }
        self.lru_.push_back(Entry{n, std::move(block), self.epoch_});
        self.by_size_[n].push_back(std::prev(self.lru_.end()));
        self.stats_.cached_bytes += bytes;
        self.stats_.peak_cached_bytes = std::max(self.stats_.peak_cached_bytes, self.stats_.cached_bytes);
      }
    }
    // `block` (when not cached) and `evicted` go back to the wrapped allocator here.
  }

  CachingAllocator() = default;

  mutable std::mutex mutex_;
  c10::Allocator* inner_ = nullptr;
  bool enabled_ = false;
  int64_t min_bytes_ = 0;
  int64_t max_cached_bytes_ = 0;
  int64_t epoch_ = 0;
  std::unordered_map<void*, Live> live_;
  std::list<Entry> lru_;  // free blocks, oldest first
  std::unordered_map<size_t, std::vector<std::list<Entry>::iterator>> by_size_;
  BlockCacheStats stats_;
};

}  // namespace

ScopedBlockCache::ScopedBlockCache(int64_t min_bytes, int64_t max_cached_bytes) {
  CachingAllocator::get().install(min_bytes, max_cached_bytes);
}
ScopedBlockCache::~ScopedBlockCache() { CachingAllocator::get().uninstall(); }
BlockCacheStats ScopedBlockCache::stats() const { return CachingAllocator::get().stats(); }
void ScopedBlockCache::next_step() { CachingAllocator::get().next_step(); }

}  // namespace bert
