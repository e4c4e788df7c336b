// ParameterStore: owns the model's parameter storage (StagePlan::Parameters) and keeps it whole
// where the model reads it.
//   Whole:   one flat buffer, full length, that the parameters are views of; sharded plans
//            all-gather it after each update.
//   PerUnit: stage 3 (Note [Stage 3 units]). This rank's shard of every bucket is the storage;
//            each unit also has one full buffer (its buckets back to back, so a parameter split
//            across two of them is still one contiguous view) whose storage exists only while
//            the unit is gathered, and the parameters are views into it. Units are gathered on entry (with
//            prefetch of the next ones in the last pass's order), released on exit, gathered
//            again when backward reaches them and released once their gradients are in.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "engine/flat_state.hpp"
#include "engine/release_guard.hpp"
#include "shardopt/comm.hpp"

namespace shardopt::detail {

class ParameterStore {
 public:
  // params[i] is layout slot i, named names[i]. PerUnit: parameters are gathered in parts (the
  // buckets' unit field), the last the root part (parameters in no unit: gathered from
  // construction or gather_root() until the end of the step); unit_parts[u]: the parts declared
  // unit u needs; part_labels[p]: how errors name part p's units (Note [Released parameters] in
  // release_guard.cpp: released parameters raise a named error when read). Whole plans pass one
  // part and no unit_parts.
  ParameterStore(const FlatState& flat, std::vector<at::Tensor> params,
                 std::vector<std::string> names, std::vector<std::string> part_labels,
                 std::vector<std::vector<int>> unit_parts, CommunicatorPtr comm, Duration timeout,
                 int prefetch);
  // Lets in-flight all-gathers land before the buffers they write go away.
  ~ParameterStore();

  // Takes over the parameters' storage with their initial values (rank 0's on every rank when
  // `broadcast`, as DDP does) and returns those values in `master_options`, the master weights'
  // start (FlatState::init_master): the full flat buffer (Whole), or this rank's shard
  // (PerUnit). The parameters become views into the store's storage (same TensorImpl, so
  // autograd identity is kept); construction holds about one copy of the model (Note [One copy
  // at construction] in parameter_store.cpp). PerUnit: the parameters start released but the
  // root part, which is gathered.
  at::Tensor adopt(const at::TensorOptions& master_options, bool broadcast);
  // The model's storage of a bucket's updated range (the update's target or its low copy).
  at::Tensor model_slice(int bucket, const UpdatedRange& range) const;
  // This rank's owned slice of a bucket in the model's storage.
  at::Tensor owned_slice(int bucket) const;
  // Whole plans: the full flat buffer.
  const at::Tensor& whole() const { return flat_params_; }

  // After the update: all-gather the updated shards (Whole), or release every part, the root
  // part included: nothing stays gathered between steps (PerUnit).
  void after_update();

  // ---- PerUnit: the unit runtime (declared units in, parts gathered) -------------------------
  int root_unit() const { return root_unit_; }
  // A declared unit's forward starts / ends: its parts are gathered for it (a unit may run
  // several times in one forward; a part shared by two units is gathered while either runs).
  // enter(unit, /*in_backward=*/true): a unit run again inside backward (a recomputation that
  // calls Units::run or the Python hooks): gathered as usual, but the run is not part of the
  // forward order that guides prefetch.
  void enter(int unit, bool in_backward = false);
  void exit(int unit);
  // Backward reached the unit's outputs: gather its parts, prefetch the unit backward reaches
  // next.
  void before_backward(int unit);
  // Frees part `part` (its gradients are all in).
  void release(int part);
  // Gathers the root part (parameters in no unit) if it is not: before a forward (zero_grad()
  // or the first unit entered).
  void gather_root();
  // End of a backward pass: parts left over but the root are freed; this pass's order guides
  // prefetch.
  void end_backward();
  // Gathers every unit (to read or save the whole model outside Units::run).
  void gather_full();

  // ---- PerUnit, automatic units (src/engine/auto_gather.hpp drives these) ----------------------
  // Before adopt(): the parameters keep the release guard's key for good and operations
  // on them call `owner` (release_guard.hpp), instead of Units::run entering their units.
  void set_automatic(GatherOnUse* owner) { automatic_ = owner; }
  int parts() const { return static_cast<int>(units_.size()); }
  bool part_gathered(int part) const { return units_[part].gathered; }
  void prefetch_part(int part);  // starts gathering it (no wait)
  void gather_part(int part);    // gathered when it returns

  int64_t take_comm_elements();
  int64_t param_bytes() const;     // the model's storage (PerUnit: the shard)
  int64_t gathered_bytes() const;  // PerUnit: full buffers holding storage now

 private:
  struct UnitState {
    std::vector<int> buckets;
    at::Tensor full;             // the buckets' full buffers back to back
    std::vector<int> params;     // layout slots of its parameters (guarded while released)
    bool gathered = false;       // storage allocated (and filled once `works` complete)
    std::vector<WorkPtr> works;  // all-gathers in flight
    int active = 0;              // declared units using it in forward right now
    bool backward = false;       // gathered for its backward: a recomputation's exit keeps it
  };
  at::Tensor adopt_whole(const at::TensorOptions& master_options, bool broadcast);
  at::Tensor adopt_shards(const at::TensorOptions& master_options, bool broadcast);
  void launch_gather(int part);
  void ensure_gathered(int part);
  void prefetch_unit(int unit);
  void prefetch_after(int unit);

  const FlatState& flat_;
  const StagePlan plan_;
  GatherOnUse* automatic_ = nullptr;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<std::string> part_labels_;
  CommunicatorPtr comm_;
  Duration timeout_;
  int prefetch_ = 1;
  int rank_ = 0;
  at::Tensor flat_params_;        // Whole: every parameter, full length
  at::Tensor shard_;              // PerUnit: this rank's slice of every bucket
  std::vector<at::Tensor> full_;  // PerUnit: per bucket, a view of its unit's full buffer
  std::vector<UnitState> units_;  // parts: declared units' own, shared ones, the root
  std::vector<std::vector<int>> unit_parts_;  // declared unit -> its parts
  int root_unit_ = 0;
  std::vector<int> forward_order_;   // units entered in this pass
  std::vector<int> previous_order_;  // ... and in the last pass (prefetch order)
  size_t backward_cursor_ = 0;       // backward is at the run forward_order_[cursor]
  int64_t comm_elements_ = 0;
};

}  // namespace shardopt::detail
