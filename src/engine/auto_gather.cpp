// AutoGather: gathering stage-3 parts on first use.
//
// Note [Automatic units]
// Without a Units object, stage 3 derives units from the parameters' names (shardopt/
// unit_policy.hpp) and builds the same parts as declared units would (Note [Stage 3 units] in
// engine.cpp: a tied parameter whose names fall in two units gets a part of its own; small groups
// form the root part, which persists through the step). Nothing in the model calls Units::run,
// so the parts are driven from the dispatcher instead: the parameters carry the release guard's
// dispatch key for good (release_guard.cpp), and views made from them (weight.t() saved by addmm,
// p.data) inherit it, because view kernels copy their base's key set. Every operation on such a
// tensor, in forward, in backward (reading what autograd saved) or anywhere else, first reaches
// the guard's fallback, which gathers the parts the operation reads and then runs it below the
// key. Autograd therefore records the real parameters; a part released between forward and
// backward is gathered again when backward first reads it, and the gather writes the part's
// buffer, never the parameters' version counters, so unpacking saved leaves stays valid.
//   Forward: a part is gathered on first use and released when the trace says its use is over
//   (Note [Reuse distance]). A part used again later (a tied embedding at the decoder) is
//   gathered again unless it was kept.
//   Backward: a part is gathered when backward first reads it (NeededInBackward, Note [Part
//   lifecycle] in parameter_store.cpp) and released once its gradients are in (the engine's
//   tracker), as for declared units; end of backward frees the rest but the root.
//   Trace: the order of first uses in forward, then in backward, is recorded per pass. After the
//   first backward it is compared across ranks (a hash, one all-reduce); if it differs, prefetch
//   and the trace-driven release stay off with one warning (collectives must be issued in the
//   same order everywhere). Otherwise the forward gathers the next `prefetch` parts of the last
//   pass's order when it reaches a part at the same position, and backward those that came
//   before it in this pass's forward.
// Communication per micro-step: a part is all-gathered at each forward use that finds it
// released and once in backward unless forward kept it, and reduce-scattered once; the root part
// is all-gathered once per step. Declared units release every unit when its run ends and gather
// it again in backward; here the parts whose backward use is near stay gathered through the loss
// into backward, which saves their backward gathers (BERT: the last encoder layer and the
// embeddings that the tied decoder used last) at the cost of holding them meanwhile
// (bench/RESULTS.md: BERT peer, 2.92 Psi per step vs 3.70 Psi with its explicit units, peak +0.1%).
//
// Note [Reuse distance]
// When forward starts a new part-use at position k of the trace (the last pass's forward order,
// then its backward order), and only then, every gathered part the operation does not read is
// looked up (operations on the root part or on the current part decide nothing): if its
// next use in the trace is at most ZeroOptions::reuse_distance positions ahead it stays gathered,
// otherwise (or if it is not used again) it is released. The backward half is what keeps the
// forward's last parts for backward: near the end of forward their backward uses are close. So
// 0 frees every part as soon as another starts; 1 keeps a part read again right after the next
// (a layer around a shared bias); the default 2 also keeps, at the end of forward, the part
// before the last for backward; a distance longer than the trace keeps every part until
// backward's gradients free it (stage-2 memory, 2 Psi per step). Releases are no collectives, but
// they decide which later uses gather, so every rank must decide alike: the trace is the one
// checked across ranks, and the decision uses only it and positions. Fallback, while there is no
// usable trace (the first pass, ranks that disagreed, a forward that left the trace, forwards
// without backward that overran it): the `keep` most recently used parts stay gathered, older
// ones are released.
// Cost: one boxed fallback per operation on a parameter (gathered or not), measured in
// bench/RESULTS.md. What bypasses the dispatcher bypasses this too: code that reads data_ptr()
// of a parameter directly, or a TorchScript fuser kernel that takes a parameter as input (CPU
// fusion is off by default in torch): such code sees no bytes while the part is released; call
// DistributedOptimizer::gather_full_parameters() first (outside a pass), or disable the fuser
// (CUDA: nvFuser on torch 1.12-1.13, NNC on 2.x; README "Stage 3"). Collectives are issued from
// whichever rank's operation needs them: every rank must run the same operations on the
// parameters (as DDP assumes of its buckets); a read on one rank alone times out and raises the
// released parameter's named error (release_guard.cpp), tested by AutoUnitsReleasedRead.
#include "engine/auto_gather.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/graph_task.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>

namespace shardopt::detail {

AutoGather::AutoGather(ParameterStore& store, int root, int prefetch, int reuse_distance,
                       CommunicatorPtr comm, Duration timeout, int keep)
    : store_(store), root_(root), prefetch_(prefetch), comm_(std::move(comm)), timeout_(timeout),
      reuse_distance_(static_cast<size_t>(std::max(0, reuse_distance))),
      keep_(static_cast<size_t>(std::max(1, keep))),
      last_at_(static_cast<size_t>(store.part_count()), 0) {}

void AutoGather::use(const std::vector<int>& parts) {
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

void AutoGather::forward_use(const std::vector<int>& parts) {
  const bool prefetching = checked_ && trace_ok_ && prefetch_ > 0;
  bool started = false;  // a new part-use: the only point where forward releases
  for (int part : parts) {
    if (part == root_) {
      store_.gather_root();
      continue;
    }
    if (order_.empty() || order_.back() != part) {
      if (order_.size() > 4 * static_cast<size_t>(store_.part_count()) + 16) {
        order_.clear();  // forwards without a backward (evaluation): a new trace starts
        following_ = false;  // ... which the last pass's trace does not describe
      }
      order_.push_back(part);
      started = true;
      const size_t k = order_.size() - 1;
      last_at_[part] = k;
      following_ = following_ && k < previous_.size() && previous_[k] == part;
      if (prefetching && k < previous_.size() && previous_[k] == part) {
        store_.prefetch_part(part);  // first in line, then the ones the trace says come next
        for (size_t i = 1; i <= static_cast<size_t>(prefetch_) && k + i < previous_.size(); ++i) {
          if (previous_[k + i] != root_) store_.prefetch_part(previous_[k + i]);
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
  if (started) {
    if (following_) {
      release_by_trace(parts);
    } else {
      release_by_window(parts);
    }
  }
  cursor_ = order_.size();
}

void AutoGather::release_by_trace(const std::vector<int>& parts) {
  const size_t k = order_.size() - 1;  // recent_ is empty while order_ is
  for (auto it = recent_.begin(); it != recent_.end();) {
    const int part = *it;
    const size_t next = next_[last_at_[part]];  // > k: this forward followed the trace
    const bool in_use = std::find(parts.begin(), parts.end(), part) != parts.end();
    if (in_use || (next != kNever && next - k <= reuse_distance_)) {
      ++it;
      continue;
    }
    store_.release(part);
    it = recent_.erase(it);
  }
}

// The fallback without a usable trace: the least recently used parts beyond the window go, never
// one this operation reads.
void AutoGather::release_by_window(const std::vector<int>& parts) {
  for (auto it = recent_.begin(); recent_.size() > keep_ && it != recent_.end();) {
    if (std::find(parts.begin(), parts.end(), *it) != parts.end()) {
      ++it;
      continue;
    }
    store_.release(*it);
    it = recent_.erase(it);
  }
}

void AutoGather::backward_use(int part) {
  if (backward_.empty() || backward_.back() != part) {
    // Backward passes that never reach the engine's end (gradients of inputs only): start over.
    if (backward_.size() > 4 * static_cast<size_t>(store_.part_count()) + 16) backward_.clear();
    backward_.push_back(part);
  }
  if (!store_.part_gathered(part) && checked_ && trace_ok_ && prefetch_ > 0) {
    // Backward reaches the parts in reverse forward order: prefetch those before this one.
    size_t at = std::min(cursor_, order_.size());
    while (at > 0 && order_[at - 1] != part) --at;
    if (at > 0) {
      cursor_ = at - 1;
      store_.prefetch_part(part);
      for (size_t i = 1; i <= static_cast<size_t>(prefetch_) && cursor_ >= i; ++i) {
        if (order_[cursor_ - i] != root_) store_.prefetch_part(order_[cursor_ - i]);
      }
    }
  }
  store_.gather_for_backward(part);
}

void AutoGather::end_backward() {
  if (!checked_) {
    checked_ = true;
    if (comm_->size() > 1) {
      uint32_t h = 2166136261u;  // FNV-1a over the order of first uses, forward then backward
      auto add = [&h](uint32_t word) {
        for (int byte = 0; byte < 4; ++byte) h = (h ^ ((word >> (8 * byte)) & 0xffu)) * 16777619u;
      };
      for (int part : order_) add(static_cast<uint32_t>(part));
      add(0xffffffffu);
      for (int part : backward_) add(static_cast<uint32_t>(part));
      const size_t uses = order_.size() + 31 * backward_.size();
      const double mine = static_cast<double>(h) + 1e10 * static_cast<double>(uses % 1000);
      at::Tensor both = at::tensor({mine, -mine}, at::kDouble);
      comm_->all_reduce(both, ReduceOp::Max, true)->wait(timeout_);
      trace_ok_ = both[0].item<double>() == -both[1].item<double>();
      if (!trace_ok_ && comm_->rank() == 0) {
        fmt::print(stderr,
                   "shardopt: stage 3: the ranks used the automatic units in different orders in "
                   "the first pass (control flow that depends on the data?); prefetch is off and "
                   "forward keeps the last {} parts gathered\n", keep_);
      }
    }
  }
  previous_ = std::move(order_);
  order_.clear();
  make_trace();
  recent_.clear();
  cursor_ = 0;
  following_ = trace_ok_ && !previous_.empty();
}

// trace_: the forward order, then the backward order; next_[i]: where trace_[i]'s part is used
// next (kNever: not again in the pass).
void AutoGather::make_trace() {
  trace_ = previous_;
  trace_.insert(trace_.end(), backward_.begin(), backward_.end());
  backward_.clear();
  next_.assign(trace_.size(), kNever);
  std::vector<size_t> seen(last_at_.size(), kNever);
  for (size_t i = trace_.size(); i-- > 0;) {
    next_[i] = seen[trace_[i]];
    seen[trace_[i]] = i;
  }
}

}  // namespace shardopt::detail
