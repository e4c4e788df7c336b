// Stage-3 schedulers: the policy over PartStore's parts (the mechanism). One interface with the
// four moments of a use (FSDP2's FSDPParamGroup: pre-forward, post-forward, pre-backward,
// post-backward), one use trace checked across ranks (Note [Use trace] in
// shardopt/detail/use_trace.hpp), two implementations: DeclaredUnits (Units::run and its output
// hooks) and AutoUnits (Note [Automatic units] in auto_gather.cpp).
#pragma once

#include <cstddef>
#include <deque>
#include <vector>

#include "engine/part_store.hpp"
#include "engine/release_guard.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/detail/use_trace.hpp"

namespace shardopt::detail {

// Note [One owner of releases]: a scheduler decides when each part is gathered, prefetched and
// released; the engine only reports the moments (a unit's forward starts and ends, backward reaches
// its outputs, a part's gradients are all in, pass and step boundaries) and the store only does
// what it is asked. tests/cmake/release_rule.cmake keeps it so: no other file in src/ calls the
// store's gather, prefetch or release.
class PartScheduler {
 public:
  PartScheduler(PartStore& store, int ids, CommunicatorPtr comm, Duration timeout,
                int prefetch);
  virtual ~PartScheduler() = default;

  // The four moments. Declared units report `unit` (its parts); automatic units report parts
  // from the dispatcher (use()) and have no post-forward moment.
  virtual void pre_forward(int unit, bool in_backward) { (void)unit, (void)in_backward; }
  virtual void post_forward(int unit) { (void)unit; }
  virtual void pre_backward(int unit) { (void)unit; }
  // Every gradient of `part` is in: its backward is over.
  void post_backward(int part) { release(part); }
  // Note [Parts held through a step]: true keeps every gathered part until the update.
  void hold_through_step(bool hold) { hold_ = hold; }

  // zero_grad(): a forward follows; the parameters in no unit are gathered for it.
  void start_forward() { store_.gather_root(); }
  // End of a backward pass: parts left over but the root are freed; the pass becomes the trace.
  virtual void end_backward();
  // step() wrote new values: PartStore::after_update() dropped every stale copy.
  virtual void after_step() {}
  // gather_full_parameters(): every part, outside a pass.
  void gather_all() { store_.gather_full(); }

 protected:
  virtual const char* trace_names() const = 0;
  // Every release decided here goes through this (Note [Parts held through a step]).
  void release(int part) {
    if (!hold_) store_.release(part);
  }

  PartStore& store_;
  UseTrace trace_;
  CommunicatorPtr comm_;
  Duration timeout_;
  int prefetch_;
  bool hold_ = false;
};

// Declared units (Units::run): a unit's parts are gathered for each run, released when no running
// unit needs them; gathered again at the outputs' backward hook, released with their gradients.
class DeclaredUnits final : public PartScheduler {
 public:
  // unit_parts[u]: the parts declared unit u needs.
  DeclaredUnits(PartStore& store, std::vector<std::vector<int>> unit_parts,
                CommunicatorPtr comm, Duration timeout, int prefetch);
  // in_backward: a unit run again inside backward (a recomputation): gathered as usual, but not
  // part of the forward order that guides prefetch.
  void pre_forward(int unit, bool in_backward) override;
  void post_forward(int unit) override;
  void pre_backward(int unit) override;

 private:
  const char* trace_names() const override { return "declared units"; }
  void prefetch_unit(int unit);

  std::vector<std::vector<int>> unit_parts_;
  std::vector<int> runs_;  // per part: declared units running it in forward right now
};

// Automatic units (Note [Automatic units] in auto_gather.cpp): parts gathered on first use and
// released in forward by the trace (Note [Reuse distance]).
class AutoUnits final : public PartScheduler, public GatherOnUse {
 public:
  AutoUnits(PartStore& store, int prefetch, int reuse_distance, CommunicatorPtr comm,
            Duration timeout);

  void use(const std::vector<int>& parts) override;
  void end_backward() override;
  void after_step() override { recent_.clear(); }

 private:
  const char* trace_names() const override { return "automatic units"; }
  void forward_use(const std::vector<int>& parts);
  void backward_use(int part);
  void release_after_use(const std::vector<int>& parts);

  static constexpr size_t kKeep = 2;  // without a usable trace, the parts forward keeps gathered
  int root_;  // the persistent part
  size_t reuse_distance_;
  std::deque<int> recent_;  // forward: gathered parts, least recently used first
};

}  // namespace shardopt::detail
