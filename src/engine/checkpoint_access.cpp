// CheckpointAccess: what checkpoints read and write, over the engine's pieces.
#include "engine/checkpoint_access.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: not reached through ATen.h on torch 2.6

#include "engine/group_options.hpp"

namespace shardopt::detail {

CheckpointAccess::CheckpointAccess(const ZeroOptions& options, const Ranks& ranks,
                                   const CollectedModel& model, FlatState& flat,
                                   ParameterStore& store, LocalUpdate& update,
                                   torch::optim::Optimizer& owner,
                                   std::optional<LossScaler>& scaler, int64_t& steps,
                                   std::function<void()> restart)
    : options_(options), ranks_(ranks), model_(model), flat_(flat), store_(store),
      update_(update), owner_(owner), scaler_(scaler), steps_(steps),
      restart_(std::move(restart)) {}

at::ScalarType CheckpointAccess::master_dtype() const {
  return flat_.master_options().dtype().toScalarType();
}

// The master weights: the separate (fp32 / host) copy, or the model's own storage.
at::Tensor CheckpointAccess::owned_param_slice(int bucket) {
  if (flat_.plan().separate_master()) return flat_.owned_master_slice(bucket);
  return store_.owned_slice(bucket);
}

at::Tensor CheckpointAccess::owned_state_slice(int state, int bucket) {
  return flat_.owned_state_slice(state, bucket);
}

int CheckpointAccess::group_count() const { return static_cast<int>(owner_.param_groups().size()); }

Rule CheckpointAccess::group_rule(int group) const { return group_rule_of(owner_, group); }

void CheckpointAccess::set_group_rule(int group, const Rule& rule) {
  group_rule_of(owner_, group) = rule;
}

std::optional<LossScaler::State> CheckpointAccess::loss_scaler_state() const {
  if (!scaler_) return std::nullopt;
  return scaler_->state();
}

void CheckpointAccess::set_loss_scaler_state(const LossScaler::State& state) {
  if (scaler_) scaler_->set_state(state);
}

void CheckpointAccess::after_load() {
  at::NoGradGuard no_grad;
  const auto& plan = flat_.plan();
  if (!plan.sharded()) {
    // Every rank holds everything when replicated: assemble the full master weights and state.
    const auto& comm = ranks_.shard;
    const int rank = comm->rank();
    std::vector<WorkPtr> works;
    for (const auto& bl : flat_.layout().buckets) {
      auto gather_bucket = [&](const at::Tensor& full) {
        at::Tensor range = full.narrow(0, bl.flat_offset, bl.padded);
        works.push_back(comm->all_gather(range.narrow(0, rank * bl.shard, bl.shard), range, true));
      };
      if (plan.separate_master()) gather_bucket(flat_.master());  // else the store's, below
      for (auto& s : flat_.state()) gather_bucket(s);
    }
    for (auto& w : works) w->wait(options_.timeout);
  }
  update_.write_back();  // master -> model dtype
  store_.after_load();
  restart_();
}

}  // namespace shardopt::detail
