// AutoGather: stage 3 with automatic units (Note [Automatic units] in auto_gather.cpp). Operations
// on the parameters reach it through the release guard's dispatch key; it gathers their parts on
// first use, releases them in forward from a window of recently used parts, prefetches from the
// order recorded in the last pass, and checks once that every rank recorded the same order.
#pragma once

#include <cstddef>
#include <deque>
#include <vector>

#include "engine/parameter_store.hpp"
#include "engine/release_guard.hpp"
#include "shardopt/comm.hpp"

namespace shardopt::detail {

class AutoGather final : public GatherOnUse {
 public:
  // root: the part that persists (gathered on use, released by step()); prefetch: parts gathered
  // ahead; keep: parts kept gathered in forward (the current one and those before it), so a part
  // used again soon (a bias next to a tied decoder) is not gathered twice.
  AutoGather(ParameterStore& store, int root, int prefetch, CommunicatorPtr comm,
             Duration timeout, int keep = 2);

  void use(const std::vector<int>& parts) override;
  // End of a backward pass: this pass's forward order becomes the trace the next pass prefetches
  // from (after the first pass: once every rank is found to have recorded the same order).
  void end_backward();
  // step(): every part is released (ParameterStore::after_update), the window starts over.
  void after_update() { recent_.clear(); }

  bool trace_agreed() const { return trace_ok_; }

 private:
  void forward_use(const std::vector<int>& parts);
  void backward_use(int part);

  ParameterStore& store_;
  int root_;
  int prefetch_;
  CommunicatorPtr comm_;
  Duration timeout_;
  size_t keep_;
  std::vector<int> order_;     // parts in order of first use in this pass's forward
  std::vector<int> previous_;  // ... in the last pass's (the trace)
  std::deque<int> recent_;     // forward: gathered parts, least recently used first
  size_t cursor_ = 0;          // backward: at order_[cursor_ - 1]
  bool checked_ = false;       // the trace was compared across ranks
  bool trace_ok_ = true;       // ... and agreed (else: no prefetch)
};

}  // namespace shardopt::detail
