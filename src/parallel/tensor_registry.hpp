// TensorRegistry: what the library records on a tensor (Note [Split records] in
// shardopt/tensor_parallel.hpp; the pipeline-shared mark in shardopt/pipeline_runner.hpp). at::Tensor
// has no attribute slot, so a process-wide map keyed by the TensorImpl, shared by every rank of the
// thread engine (hence the mutex), that never keeps a parameter's memory alive.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>

namespace shardopt::detail {

template <class Record>
class TensorRegistry {
 public:
  void put(const at::Tensor& t, Record record) {
    std::lock_guard<std::mutex> lock(mutex_);
    // Entries of freed tensors are dropped whenever the map has doubled since the last sweep, so
    // it stays within twice the live parameters' count.
    if (entries_.size() >= 2 * live_after_sweep_ + 64) {
      for (auto it = entries_.begin(); it != entries_.end();) {
        it = it->second.impl.expired() ? entries_.erase(it) : std::next(it);
      }
      live_after_sweep_ = entries_.size();
    }
    entries_.insert_or_assign(t.unsafeGetTensorImpl(),
                              Entry{WeakImpl(t.getIntrusivePtr()), std::move(record)});
  }

  std::optional<Record> get(const at::Tensor& t) const {
    if (!t.defined()) return std::nullopt;
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = entries_.find(t.unsafeGetTensorImpl());
    if (it == entries_.end() || it->second.impl.expired()) return std::nullopt;
    return it->second.record;
  }

 private:
  using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  // A weak reference keeps the TensorImpl object (not its storage) allocated, so its address
  // cannot be reused by a new tensor while the entry exists: a lookup by address finds only its
  // own tensor.
  struct Entry {
    WeakImpl impl;
    Record record;
  };
  mutable std::mutex mutex_;
  std::unordered_map<const c10::TensorImpl*, Entry> entries_;
  size_t live_after_sweep_ = 0;
};

}  // namespace shardopt::detail
