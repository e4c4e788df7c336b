// Stage-3 schedulers: the common moments and declared units (automatic units: auto_gather.cpp).
#include "engine/part_scheduler.hpp"

#include <ATen/ATen.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>

namespace shardopt::detail {

PartScheduler::PartScheduler(PartStore& store, int ids, CommunicatorPtr comm,
                             Duration timeout, int prefetch)
    : store_(store), trace_(ids), comm_(std::move(comm)), timeout_(timeout),
      prefetch_(std::max(0, prefetch)) {}

// Note [Parts held through a step]
// Under pipelines a stage runs its units once per micro-batch, forward and backward: released
// between uses, each unit would be gathered 2m times a step. Held (ZeroOptions::
// reshard_between_uses false, the default under pipelines, as torchtitan's
// reshard_after_forward=False for pipeline stages), no release is decided in the step: a unit
// stays whole from its first gather to the update, whose PartStore::after_update() drops every
// gathered copy (the values are stale then). Each parameter is gathered once per step; the cost is
// the memory of every unit this rank runs, whole, for the step. It also lets a zero-bubble weight
// pass, deferred past the unit's input-gradient pass, read the unit's parameters.
void PartScheduler::end_backward() {
  // Parts whose parameters got no gradient (or a prefetch nobody used) are freed here; the root
  // part stays until the step (another micro-step's forward needs it).
  for (int part = 0; part < store_.root_part(); ++part) release(part);
  bool agreed = true;  // Note [Use trace]: the first pass is compared across ranks
  if (!trace_.checked() && comm_->size() > 1) {
    // Gathered, not reduced: a flag, never counted with the gradients' reductions.
    const uint64_t h = trace_.fingerprint();
    at::Tensor mine = at::tensor({static_cast<double>(h >> 32),
                                  static_cast<double>(h & 0xffffffffu)}, at::kDouble);
    at::Tensor all = at::empty({2 * comm_->size()}, at::kDouble);
    comm_->all_gather(mine, all, true)->wait(timeout_);
    agreed = all.view({-1, 2}).eq(mine).all().item<bool>();
    if (!agreed && comm_->rank() == 0) {
      fmt::print(stderr, "shardopt: stage 3: the ranks used the {} in different orders in the "
                 "first pass (control flow that depends on the data?); prefetch is off\n",
                 trace_names());
    }
  }
  trace_.end_backward(agreed);
}

DeclaredUnits::DeclaredUnits(PartStore& store, std::vector<std::vector<int>> unit_parts,
                             CommunicatorPtr comm, Duration timeout, int prefetch)
    : PartScheduler(store, static_cast<int>(unit_parts.size()), std::move(comm), timeout,
                    prefetch),
      unit_parts_(std::move(unit_parts)), runs_(store.part_count(), 0) {}

// A unit's forward starts (a unit may run several times in one forward): its parts are gathered,
// and the units that came next in the last pass are prefetched (declaration order at first).
void DeclaredUnits::pre_forward(int unit, bool in_backward) {
  if (!in_backward) {
    store_.gather_root();  // a forward is running: parameters in no unit are needed too
    trace_.forward(unit);
  }
  for (int part : unit_parts_[unit]) {
    ++runs_[part];
    store_.gather_part(part);
  }
  if (in_backward || (trace_.checked() && !trace_.usable())) return;
  const size_t k = trace_.position();
  const int units = static_cast<int>(unit_parts_.size());
  for (int i = 1; i <= prefetch_; ++i) {
    int next = trace_.previous_at(k + i);
    if (next < 0 && !trace_.checked()) next = unit + i;
    if (next >= 0 && next < units) prefetch_unit(next);
  }
}

// The unit's forward ends: parts no running unit needs are released, but a recomputation inside
// the unit's backward (Note [Recompute and ZeRO], recompute.hpp) ends while backward still needs
// them: they go when their gradients are in.
void DeclaredUnits::post_forward(int unit) {
  for (int part : unit_parts_[unit]) {
    if (--runs_[part] > 0) continue;
    runs_[part] = 0;
    if (store_.part_state(part) != PartState::NeededInBackward) release(part);
  }
}

// Backward reached the unit's outputs: its parts are gathered for backward, and the unit backward
// reaches next is prefetched.
void DeclaredUnits::pre_backward(int unit) {
  for (int part : unit_parts_[unit]) store_.gather_for_backward(part);
  trace_.backward(unit);
  const auto next = trace_.before_in_forward(unit, prefetch_);
  if (trace_.checked() && !trace_.usable()) return;
  for (int u : next) prefetch_unit(u);
}

void DeclaredUnits::prefetch_unit(int unit) {
  for (int part : unit_parts_[unit]) store_.prefetch_part(part);
}

}  // namespace shardopt::detail
