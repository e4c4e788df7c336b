// AutoGather: stage 3 with automatic units (Note [Automatic units] in auto_gather.cpp). Operations
// on the parameters reach it through the release guard's dispatch key; it gathers their parts on
// first use, releases them in forward once the trace recorded in the last pass says their next use
// is farther than the reuse distance (Note [Reuse distance]), prefetches from that trace, and
// checks once that every rank recorded the same one.
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
  // ahead; reuse_distance: in forward, a part whose next use in the trace is at most this many
  // part-uses ahead stays gathered (ZeroOptions::reuse_distance); keep: without a usable trace,
  // the parts kept gathered in forward (the current one and those before it).
  AutoGather(ParameterStore& store, int root, int prefetch, int reuse_distance,
             CommunicatorPtr comm, Duration timeout, int keep = 2);

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
  // Forward, after a use at trace position order_.size() - 1: releases the gathered parts the
  // operation does not read whose use is over (Note [Reuse distance]).
  void release_by_trace(const std::vector<int>& parts);
  void release_by_window(const std::vector<int>& parts);
  void make_trace();

  static constexpr size_t kNever = static_cast<size_t>(-1);

  ParameterStore& store_;
  int root_;
  int prefetch_;
  CommunicatorPtr comm_;
  Duration timeout_;
  size_t reuse_distance_;
  size_t keep_;
  std::vector<int> order_;     // parts in order of first use in this pass's forward
  std::vector<int> backward_;  // ... and in its backward
  std::vector<int> previous_;  // the last pass's forward order (the trace) ...
  std::vector<int> trace_;     // ... followed by its backward order
  std::vector<size_t> next_;   // trace_[next_[i]]: the next use of part trace_[i] (or npos)
  std::vector<size_t> last_at_;  // per part: its last position in this forward's order_
  std::deque<int> recent_;     // forward: gathered parts, least recently used first
  size_t cursor_ = 0;          // backward: at order_[cursor_ - 1]
  bool checked_ = false;       // the trace was compared across ranks
  bool trace_ok_ = true;       // ... and agreed (else: no prefetch, no trace-driven release)
  bool following_ = false;     // this forward has matched the trace so far
};

}  // namespace shardopt::detail
