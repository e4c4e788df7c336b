// CheckpointAccess: ShardAccess (what src/checkpoint reads and writes) implemented over the
// engine's pieces: the layout and master weights (FlatState), the model's storage
// (ParameterStore), the write-back of the master weights (LocalUpdate), the group rules (the
// torch param groups) and the loss scaler. The Engine owns one and hands it out.
#pragma once

#include <atomic>
#include <functional>
#include <optional>
#include <utility>

#include "engine/flat_state.hpp"
#include "engine/group_options.hpp"
#include "engine/local_update.hpp"
#include "engine/model_check.hpp"
#include "engine/parameter_store.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/precision.hpp"

namespace shardopt::detail {

// Who the ranks are: the communicator the pieces shard over and, under hybrid sharding, the world
// and this rank's shard group (replica).
struct Ranks {
  CommunicatorPtr world;  // as given
  CommunicatorPtr shard;  // world, or its shard group
  int replica = 0;
  int replicas = 1;
};

class CheckpointAccess final : public ShardAccess {
 public:
  // `steps`: the engine's step counter; `restart`: after a load, the engine starts the next step
  // afresh (gradients cleared, counters reset).
  CheckpointAccess(const ZeroOptions& options, const Ranks& ranks, const CollectedModel& model,
                   FlatState& flat, ParameterStore& store, LocalUpdate& update,
                   torch::optim::Optimizer& owner, std::optional<LossScaler>& scaler,
                   int64_t& steps, std::function<void()> restart)
      : options_(options), ranks_(ranks), model_(model), flat_(flat), store_(store),
        update_(update), owner_(owner), scaler_(scaler), steps_(steps),
        restart_(std::move(restart)) {}

  const FlatLayout& layout() const override { return flat_.layout(); }
  const ZeroOptions& zero_options() const override { return options_; }
  const CommunicatorPtr& comm() const override { return ranks_.shard; }
  const CommunicatorPtr& world_comm() const override { return ranks_.world; }
  int replica() const override { return ranks_.replica; }
  int replicas() const override { return ranks_.replicas; }
  const std::string& param_name(int index) const override { return model_.params[index].name; }
  int64_t param_order(int index) const override { return model_.params[index].order; }
  std::vector<int64_t> param_shape(int index) const override {
    return model_.params[index].tensor.sizes().vec();
  }
  const at::Tensor& param_tensor(int index) const override { return model_.params[index].tensor; }
  at::ScalarType master_dtype() const override {
    return flat_.master_options().dtype().toScalarType();
  }
  bool has_factory_optimizer() const override { return update_.factory_optimizer(); }
  int state_buffer_count() const override { return static_cast<int>(flat_.state().size()); }
  at::Tensor owned_param_slice(int bucket) override;
  at::Tensor owned_state_slice(int state, int bucket) override;
  int64_t step_count() const override { return steps_; }
  void set_step_count(int64_t steps) override { steps_ = steps; }
  int group_count() const override { return static_cast<int>(owner_.param_groups().size()); }
  Rule group_rule(int group) const override { return group_rule_of(owner_, group); }
  void set_group_rule(int group, const Rule& rule) override { group_rule_of(owner_, group) = rule; }
  std::optional<LossScaler::State> loss_scaler_state() const override {
    return scaler_ ? std::optional<LossScaler::State>(scaler_->state()) : std::nullopt;
  }
  void set_loss_scaler_state(const LossScaler::State& state) override {
    if (scaler_) scaler_->set_state(state);
  }
  void after_load() override;
  void set_snapshot_host_bytes(int64_t bytes) override { snapshot_host_bytes_ = bytes; }
  int64_t snapshot_host_bytes() const override { return snapshot_host_bytes_; }

 private:
  const ZeroOptions& options_;
  Ranks ranks_;
  const CollectedModel& model_;
  FlatState& flat_;
  ParameterStore& store_;
  LocalUpdate& update_;
  torch::optim::Optimizer& owner_;
  std::optional<LossScaler>& scaler_;
  int64_t& steps_;
  std::function<void()> restart_;
  std::atomic<int64_t> snapshot_host_bytes_{0};  // set by MemorySnapshots' background thread too
};

}  // namespace shardopt::detail
