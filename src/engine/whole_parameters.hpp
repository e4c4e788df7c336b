// WholeParameters: stages 0-2 keep the model's parameters whole: one flat buffer, full length,
// that the parameters are views of; sharded plans all-gather it after each update.
#pragma once

#include "engine/parameter_store.hpp"

namespace shardopt::detail {

class WholeParameters final : public ParameterStore {
 public:
  using ParameterStore::ParameterStore;

  at::Tensor adopt(const at::TensorOptions& master_options, bool broadcast) override;
  at::Tensor model_slice(int bucket, const UpdatedRange& range) const override;
  at::Tensor owned_slice(int bucket) const override;
  // Sharded plans: every rank's updated slices all-gathered.
  void after_update() override;
  // A load wrote only this rank's slices: all-gathered at every stage.
  void after_load() override { gather_owned(); }
  int64_t param_bytes() const override { return static_cast<int64_t>(flat_params_.nbytes()); }

 private:
  void gather_owned();

  at::Tensor flat_params_;  // every parameter, full length
};

}  // namespace shardopt::detail
