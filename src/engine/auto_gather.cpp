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
//   Forward: a part is gathered on first use; the `keep` most recently used parts stay gathered
//   (a bias read right after the tied decoder does not regather its layer), older ones are
//   released. A part used again later (a tied embedding at the decoder) is gathered again.
//   Backward: a part is gathered when backward first reads it and released once its gradients are
//   in (the engine's tracker), as for declared units; end of backward frees the rest but the root.
//   Prefetch: the order of first uses in forward is recorded per pass. After the first backward
//   the order is compared across ranks (a hash, one all-reduce); if it differs, prefetch stays
//   off with one warning (collectives must be issued in the same order everywhere). Otherwise the
//   forward gathers the next `prefetch` parts of the last pass's order when it reaches a part at
//   the same position, and backward those that came before it in this pass's forward.
// Communication per micro-step: a part is all-gathered at each forward use that finds it
// released and once in backward unless the forward window still holds it, and reduce-scattered
// once; the root part is all-gathered once per step. Declared units release every unit when its
// run ends and gather it again in backward; here the window's last two parts stay gathered
// through the loss into backward, which saves their backward gathers (BERT: the last encoder layer
// and the embeddings that the tied decoder used last) at the cost of holding them meanwhile
// (bench/RESULTS.md: BERT peer, 2.92 Psi per step vs 3.70 Psi with its explicit units, +5% peak).
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

AutoGather::AutoGather(ParameterStore& store, int root, int prefetch, CommunicatorPtr comm,
                       Duration timeout, int keep)
    : store_(store), root_(root), prefetch_(prefetch), comm_(std::move(comm)), timeout_(timeout),
      keep_(static_cast<size_t>(std::max(1, keep))) {}

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
  for (int part : parts) {
    if (part == root_) {
      store_.gather_root();
      continue;
    }
    if (order_.empty() || order_.back() != part) {
      if (order_.size() > 4 * static_cast<size_t>(store_.part_count()) + 16) {
        order_.clear();  // forwards without a backward (evaluation): a new trace starts
      }
      order_.push_back(part);
      const size_t k = order_.size() - 1;
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
  // Release the least recently used parts beyond the window, never one this operation reads.
  for (auto it = recent_.begin(); recent_.size() > keep_ && it != recent_.end();) {
    if (std::find(parts.begin(), parts.end(), *it) != parts.end()) {
      ++it;
      continue;
    }
    store_.release(*it);
    it = recent_.erase(it);
  }
  cursor_ = order_.size();
}

void AutoGather::backward_use(int part) {
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
      uint32_t h = 2166136261u;  // FNV-1a over the order of first uses
      for (int part : order_) {
        for (int byte = 0; byte < 4; ++byte) {
          h = (h ^ ((static_cast<uint32_t>(part) >> (8 * byte)) & 0xffu)) * 16777619u;
        }
      }
      const double mine = static_cast<double>(h) + 1e10 * static_cast<double>(order_.size() % 1000);
      at::Tensor both = at::tensor({mine, -mine}, at::kDouble);
      comm_->all_reduce(both, ReduceOp::Max, true)->wait(timeout_);
      trace_ok_ = both[0].item<double>() == -both[1].item<double>();
      if (!trace_ok_ && comm_->rank() == 0) {
        fmt::print(stderr,
                   "shardopt: stage 3: the ranks used the automatic units in different orders in "
                   "the first pass (control flow that depends on the data?); prefetch is off\n");
      }
    }
  }
  previous_ = std::move(order_);
  order_.clear();
  recent_.clear();
  cursor_ = 0;
}

}  // namespace shardopt::detail
