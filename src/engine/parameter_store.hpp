// ParameterStore: owns the model's parameter storage (StagePlan::Parameters) and keeps it whole
// where the model reads it.
//   Whole:   one flat buffer, full length, that the parameters are views of; sharded plans
//            all-gather it after each update.
//   PerUnit: stage 3 (Note [Stage 3 units]). This rank's shard of every bucket is the storage;
//            each bucket also has a full buffer whose storage exists only while its unit is
//            gathered, and the parameters are views into it. Units are gathered on entry (with
//            prefetch of the next ones in the last pass's order), released on exit, gathered
//            again when backward reaches them and released once their gradients are in.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "engine/flat_state.hpp"
#include "shardopt/comm.hpp"

namespace shardopt::detail {

class ParameterStore {
 public:
  // params[i] is layout slot i, named names[i]; `unit_names` has one entry per unit, the last the
  // root unit (never released). Whole plans pass one unit. Released parameters raise a named
  // error when read (engine/release_guard.hpp).
  ParameterStore(const FlatState& flat, std::vector<at::Tensor> params,
                 std::vector<std::string> names, std::vector<std::string> unit_names,
                 CommunicatorPtr comm, Duration timeout, int prefetch);
  // Lets in-flight all-gathers land before the buffers they write go away.
  ~ParameterStore();

  // Takes the initial full flat values (master precision) as the model's storage; the
  // parameters become views into it (same TensorImpl, so autograd identity is kept).
  void adopt(const at::Tensor& initial);
  // The model's storage of a bucket's updated range (the update's target or its low copy).
  at::Tensor model_slice(int bucket, const UpdatedRange& range) const;
  // This rank's owned slice of a bucket in the model's storage.
  at::Tensor owned_slice(int bucket) const;
  // Whole plans: the full flat buffer.
  const at::Tensor& whole() const { return flat_params_; }

  // After the update: all-gather the updated shards (Whole), or release the units gathered by
  // hand and gather the root again (PerUnit).
  void after_update();

  // ---- PerUnit: the unit runtime -----------------------------------------------------------
  int root_unit() const { return root_unit_; }
  void enter(int unit);
  void exit(int unit);
  // Backward reached the unit's outputs: gather it, prefetch the unit backward reaches next.
  void before_backward(int unit);
  void release(int unit);
  // End of a backward pass: units left over are freed; this pass's order guides prefetch.
  void end_backward();
  // Gathers every unit (to read or save the whole model outside Units::run).
  void gather_full();

  int64_t take_comm_elements();
  int64_t param_bytes() const;     // the model's storage (PerUnit: the shard)
  int64_t gathered_bytes() const;  // PerUnit: full buffers holding storage now

 private:
  struct UnitState {
    std::vector<int> buckets;
    std::vector<int> params;     // layout slots of its parameters
    bool gathered = false;       // storage allocated (and filled once `works` complete)
    std::vector<WorkPtr> works;  // all-gathers in flight
  };
  void launch_gather(int unit);
  void ensure_gathered(int unit);
  void prefetch_after(int unit);

  const FlatState& flat_;
  const StagePlan plan_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<std::string> unit_names_;
  CommunicatorPtr comm_;
  Duration timeout_;
  int prefetch_ = 1;
  int rank_ = 0;
  at::Tensor flat_params_;        // Whole: every parameter, full length
  at::Tensor shard_;              // PerUnit: this rank's slice of every bucket
  std::vector<at::Tensor> full_;  // PerUnit: per bucket, storage only while its unit is gathered
  std::vector<UnitState> units_;  // declared units, then the root unit
  int root_unit_ = 0;
  std::vector<int> forward_order_;   // units entered in this pass
  std::vector<int> previous_order_;  // ... and in the last pass (prefetch order)
  int64_t comm_elements_ = 0;
};

}  // namespace shardopt::detail
