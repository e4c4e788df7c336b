// ParameterStore: owns the model's parameter storage (StagePlan::Parameters) and keeps it where the
// model reads it. One implementation per kind of plan, no branch on the plan inside either:
//   WholeParameters (whole_parameters.hpp)  stages 0-2: one flat buffer, full length
//   PartStore       (part_store.hpp)        stage 3: shards, gathered per part on request
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "engine/flat_state.hpp"
#include "shardopt/comm.hpp"

namespace shardopt::detail {

class ParameterStore {
 public:
  // params[i] is layout slot i.
  ParameterStore(const FlatState& flat, std::vector<at::Tensor> params, CommunicatorPtr comm,
                 Duration timeout)
      : flat_(flat), plan_(flat.plan()), params_(std::move(params)), comm_(std::move(comm)),
        timeout_(timeout), rank_(flat.rank()) {}
  virtual ~ParameterStore() = default;

  // Takes over the parameters' storage with their initial values (rank 0's on every rank when
  // `broadcast`, as DDP does) and returns them in `master_options` for FlatState::init_master. The
  // parameters become views into the store's storage (same TensorImpl: autograd identity kept).
  virtual at::Tensor adopt(const at::TensorOptions& master_options, bool broadcast) = 0;
  // The model's storage of a bucket's updated range (the update's target or its low copy).
  virtual at::Tensor model_slice(int bucket, const UpdatedRange& range) const = 0;
  // This rank's owned slice of a bucket in the model's storage.
  virtual at::Tensor owned_slice(int bucket) const = 0;
  // After the update: the parameters current where the model reads them.
  virtual void after_update() = 0;
  // After a checkpoint load wrote each rank's owned slices (and the master's write-back).
  virtual void after_load() { after_update(); }

  virtual int64_t param_bytes() const = 0;            // the model's storage held for good
  virtual int64_t persistent_bytes() const { return 0; }  // stage 3: persistent parts
  virtual int64_t gathered_bytes() const { return 0; }    // stage 3: other parts gathered now
  // Elements this store moved through collectives since the last call.
  int64_t take_comm_elements() { return std::exchange(comm_elements_, 0); }

 protected:
  const FlatState& flat_;
  const StagePlan plan_;
  std::vector<at::Tensor> params_;
  CommunicatorPtr comm_;
  Duration timeout_;
  int rank_ = 0;
  int64_t comm_elements_ = 0;
};

}  // namespace shardopt::detail
