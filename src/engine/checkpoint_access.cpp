// CheckpointAccess: what checkpoints read and write, over the engine's pieces.
#include "engine/checkpoint_access.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: not reached through ATen.h on torch 2.6

#include "shardopt/error.hpp"

namespace shardopt::detail {

// The master weights: the separate (fp32 / host) copy, or the model's own storage.
at::Tensor CheckpointAccess::owned_param_slice(int bucket) {
  return flat_.plan().separate_master() ? flat_.owned_master_slice(bucket)
                                        : store_.owned_slice(bucket);
}

at::Tensor CheckpointAccess::owned_state_slice(int state, int bucket) {
  // 8-bit AdamW: codes, block maxima and packed fp32 moments (Note [Quantised state in
  // checkpoints], shardopt/detail/state_sections.hpp).
  if (auto* q = update_.adam8bit()) return q->owned_state_slice(state, bucket);
  return flat_.owned_state_slice(state, bucket);
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
      if (update_.adam8bit() == nullptr) {
        for (auto& s : flat_.state()) gather_bucket(s);
      }
    }
    for (auto& w : works) w->wait(options_.timeout);
    if (auto* q = update_.adam8bit()) q->replicate_owned(*comm, options_.timeout);
  }
  update_.write_back();  // master -> model dtype
  store_.after_load();
  restart_();
}

}  // namespace shardopt::detail
