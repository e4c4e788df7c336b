// AutoUnits: the stage-3 scheduler that gathers parts on first use (part_scheduler.hpp).
//
// Note [Automatic units]
// Without a Units object, stage 3 derives units from the parameters' names (shardopt/
// unit_policy.hpp) and builds the same parts as declared units would (Note [Stage 3 units]; small
// groups form the root part, which persists). Nothing in the model calls Units::run, so the parts
// are driven from the dispatcher: the parameters carry the release guard's dispatch key for good,
// and views made from them (weight.t() saved by addmm, p.data) inherit it. Every operation on such
// a tensor, in forward, backward or elsewhere, first reaches the guard's fallback, which finds this
// scheduler and the parts through their storage (Note [Part registration] in release_guard.cpp),
// has them gathered (use()) and runs the operation below the key. So autograd records the real
// parameters, and a part released after forward is gathered again when backward first reads it
// (NeededInBackward until its gradients are in); the gather writes the part's buffer, never the
// parameters' version counters, so unpacking saved leaves stays valid. Forward releases by the
// trace (Note [Reuse distance]); the trace (Note [Use trace]) also drives prefetch, of the parts
// the last pass used next in forward, and in backward of those before the part in this forward.
// Unlike declared units, which release each unit when its run ends, parts whose backward use is
// near stay gathered into backward, saving their backward gathers (bench/log/2026-11-25-auto-units-issue-28-quiet.md: BERT peer,
// 2.92 Psi per step vs 3.70 with its explicit units, peak +0.1%).
//
// Note [Reuse distance]
// When forward starts a new part-use at position k of the trace (the last pass's forward order,
// then its backward order), and only then, every gathered part the operation does not read stays
// gathered if its next use is at most ZeroOptions::reuse_distance positions ahead, and is released
// otherwise (operations on the root part or the current part decide nothing). The backward half
// keeps the forward's last parts for backward: 0 frees every part as soon as another starts; 1
// keeps a part read again right after the next (a layer around a shared bias); the default 2 also
// keeps the part before the last for backward; a distance beyond the trace keeps every part until
// its gradients free it (stage-2 memory). Releases are no collectives but decide which later uses
// gather, so the decision uses only the cross-rank-checked trace and positions. Without a usable
// trace (the first pass, ranks that disagreed, a forward that left the trace) the kKeep most
// recently used parts stay gathered.
// Cost: one boxed fallback per operation on a parameter (bench/log/2026-11-25-auto-units-issue-28-quiet.md). What bypasses the
// dispatcher bypasses this too: code reading a parameter's data_ptr(), or a TorchScript fuser
// kernel taking one, sees no bytes while its part is released: gather_full_parameters() first, or
// disable the fuser (README "Stage 3"). Gathers are collectives issued by whichever operation needs
// them, so every rank must run the same operations on the parameters; a read on one rank alone
// times out and raises the released parameter's named error (AutoUnitsReleasedRead).
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>

#include "engine/part_scheduler.hpp"

namespace shardopt::detail {

AutoUnits::AutoUnits(PartStore& store, int prefetch, int reuse_distance, CommunicatorPtr comm,
                     Duration timeout)
    : PartScheduler(store, store.part_count(), std::move(comm), timeout, prefetch),
      root_(store.root_part()), reuse_distance_(static_cast<size_t>(std::max(0, reuse_distance))) {}

void AutoUnits::use(const std::vector<int>& parts) {
  // Inside a backward pass the autograd engine has a current graph task.
  if (torch::autograd::get_current_graph_task_exec_info() != nullptr) {
    for (int part : parts) {
      if (part == root_) {
        store_.gather_root();
      } else {
        backward_use(part);
      }
    }
    return;
  }
  forward_use(parts);
}

// The pre-forward moment of the parts one operation reads.
void AutoUnits::forward_use(const std::vector<int>& parts) {
  const bool prefetching = trace_.usable() && prefetch_ > 0;
  bool started = false;  // a new part-use: the only point where forward releases
  for (int part : parts) {
    if (part == root_) {
      store_.gather_root();
      continue;
    }
    if (trace_.forward(part)) {
      started = true;
      const size_t k = trace_.position();
      if (prefetching && trace_.previous_at(k) == part) {
        store_.prefetch_part(part);  // first in line, then the ones the trace says come next
        for (int i = 1; i <= prefetch_; ++i) {
          const int next = trace_.previous_at(k + i);
          if (next < 0) break;
          if (next != root_) store_.prefetch_part(next);
        }
      }
    }
    store_.gather_part(part);
    auto at = std::find(recent_.begin(), recent_.end(), part);
    if (at != recent_.end()) recent_.erase(at);
    recent_.push_back(part);
  }
  // Operations that read only the root part (a head between the last layer and the tied decoder)
  // or the current part start no new use: deciding there would release the current part at its
  // own position, one further from its backward use than the next part-use will be.
  if (started) release_after_use(parts);
}

// Forward, after a new part-use at trace position k: releases the gathered parts the operation
// does not read whose use is over (Note [Reuse distance]); without a usable trace, the least
// recently used beyond the kKeep window.
void AutoUnits::release_after_use(const std::vector<int>& parts) {
  const bool by_trace = trace_.following();
  const size_t k = trace_.position();  // recent_ is empty while the forward is
  for (auto it = recent_.begin(); it != recent_.end() && (by_trace || recent_.size() > kKeep);) {
    bool keep = std::find(parts.begin(), parts.end(), *it) != parts.end();
    if (by_trace && !keep) {
      const size_t next = trace_.next_use(*it);  // > k: this forward followed the trace
      keep = next != UseTrace::kNever && next - k <= reuse_distance_;
    }
    if (keep) {
      ++it;
      continue;
    }
    release(*it);
    it = recent_.erase(it);
  }
}

// The pre-backward moment: backward reaches the parts in reverse forward order, so those before
// this one are prefetched.
void AutoUnits::backward_use(int part) {
  trace_.backward(part);
  if (store_.part_state(part) == PartState::Released && trace_.usable() && prefetch_ > 0) {
    store_.prefetch_part(part);
    for (int p : trace_.before_in_forward(part, prefetch_)) {
      if (p != root_) store_.prefetch_part(p);
    }
  }
  store_.gather_for_backward(part);
}

void AutoUnits::end_backward() {
  PartScheduler::end_backward();
  recent_.clear();
}

}  // namespace shardopt::detail
