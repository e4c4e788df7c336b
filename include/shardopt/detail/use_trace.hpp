// UseTrace: the order in which one pass first uses ids (stage 3's declared units, or automatic
// parts), in forward and then in backward; the schedulers (src/engine/part_scheduler.hpp) prefetch
// and release from the last pass's. Torch-free (tests/unit/use_trace_test.cpp).
//
// Note [Use trace]
// Collectives follow the trace (prefetch), so it is used only once every rank is known to have
// recorded the same one: after the first backward the schedulers compare fingerprint() across
// ranks (one all-reduce) and pass the answer to end_backward(). A forward that grows past
// 4 * ids + 16 uses without a backward (evaluation) starts over, and so does such a backward.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "shardopt/error.hpp"

namespace shardopt::detail {

class UseTrace {
 public:
  static constexpr size_t kNever = static_cast<size_t>(-1);
  explicit UseTrace(int ids)
      : bound_(4 * static_cast<size_t>(std::max(0, ids)) + 16),
        last_at_(static_cast<size_t>(std::max(0, ids)), 0) {}

  // Forward: a use of `id` starts; false (nothing recorded) when it repeats the last one.
  bool forward(int id) {
    // An id past the trace's count wrote past last_at_ (found by ASan, issue 42).
    SHARDOPT_INTERNAL_ASSERT(id >= 0 && static_cast<size_t>(id) < last_at_.size(),
                             "use trace: id {} of a trace of {} ids", id, last_at_.size());
    cursor_ = order_.size();
    if (!order_.empty() && order_.back() == id) return false;
    if (order_.size() > bound_) {
      order_.clear();
      following_ = false;  // the last pass's trace does not describe this one
    }
    order_.push_back(id);
    const size_t k = order_.size() - 1;
    last_at_[id] = k;
    following_ = following_ && k < previous_.size() && previous_[k] == id;
    cursor_ = order_.size();
    return true;
  }
  size_t position() const { return order_.size() - 1; }  // of the last forward use
  // This forward has used the last pass's ids so far, in order, and the ranks agreed on them.
  bool following() const { return following_; }
  // The id the last pass's forward used at position k; -1 beyond it.
  int previous_at(size_t k) const { return k < previous_.size() ? previous_[k] : -1; }
  // Where the last pass's trace (forward, then backward) uses `id` next after its latest use in
  // this forward; kNever: not again. Meaningful while following().
  size_t next_use(int id) const {
    const size_t at = last_at_.at(static_cast<size_t>(id));
    return at < next_.size() ? next_[at] : kNever;
  }

  // Backward: `id` is used (recorded once per run of uses).
  void backward(int id) {
    if (!backward_.empty() && backward_.back() == id) return;
    if (backward_.size() > bound_) backward_.clear();  // passes that never reach the end
    backward_.push_back(id);
  }
  // Backward reached `id`: the ids this pass's forward used right before its latest use before
  // the cursor, nearest first, at most `count`; the cursor moves there. Empty if none.
  std::vector<int> before_in_forward(int id, int count) {
    size_t at = std::min(cursor_, order_.size());
    while (at > 0 && order_[at - 1] != id) --at;
    if (at == 0) return {};
    cursor_ = at - 1;
    std::vector<int> out;
    for (size_t i = 1; i <= static_cast<size_t>(std::max(0, count)) && cursor_ >= i; ++i) {
      out.push_back(order_[cursor_ - i]);
    }
    return out;
  }

  // FNV-1a over this pass's uses, forward then backward, for the cross-rank comparison.
  uint64_t fingerprint() const {
    uint64_t h = 14695981039346656037ull;
    auto add = [&h](uint64_t word) {
      for (int byte = 0; byte < 8; ++byte) h = (h ^ ((word >> (8 * byte)) & 0xffu)) * 1099511628211ull;
    };
    for (int id : order_) add(static_cast<uint32_t>(id));
    add(~0ull);
    for (int id : backward_) add(static_cast<uint32_t>(id));
    add(order_.size() + (backward_.size() << 32));
    return h;
  }
  // End of a backward pass: this pass becomes the trace. `agreed`: whether every rank recorded
  // the same first pass (read the first time only).
  void end_backward(bool agreed) {
    if (!checked_) agreed_ = agreed;
    checked_ = true;
    previous_ = std::move(order_);
    order_.clear();
    std::vector<int> trace = previous_;
    trace.insert(trace.end(), backward_.begin(), backward_.end());
    backward_.clear();
    next_.assign(trace.size(), kNever);
    std::vector<size_t> seen(last_at_.size(), kNever);
    for (size_t i = trace.size(); i-- > 0;) {
      next_[i] = seen[trace[i]];
      seen[trace[i]] = i;
    }
    cursor_ = 0;
    following_ = agreed_ && !previous_.empty();
  }
  bool checked() const { return checked_; }
  bool usable() const { return checked_ && agreed_; }

 private:
  size_t bound_;
  std::vector<int> order_;       // this pass's forward
  std::vector<int> backward_;    // ... and its backward
  std::vector<int> previous_;    // the last pass's forward
  std::vector<size_t> next_;     // over previous_ then its backward: the next use (or kNever)
  std::vector<size_t> last_at_;  // per id: its latest position in order_
  size_t cursor_ = 0;            // backward: at order_[cursor_ - 1]
  bool checked_ = false;
  bool agreed_ = true;
  bool following_ = false;
};

}  // namespace shardopt::detail
