// FinalizeGrads: the sums over the model-parallel grid between the reduction and the update.
#include "engine/finalize_grads.hpp"

#include <ATen/ATen.h>

namespace shardopt::detail {

// Note [Finalizing gradients over the grid]
// After the data-parallel reduction and the unscale, some gradients still miss a part that lives
// on other ranks of the grid; summing them is this piece's one job (Megatron's
// finalize_model_grads), so that the norm (GridNorm) and the update see final gradients.
//
// Parameters shared by two stages. The tied word embedding lives on the first pipeline stage (the
// lookup) and on the last (the decoder); each stage's optimizer holds a copy and its own gradient.
// The model says which tensor it is with mark_pipeline_shared, the optimizer finds the group in
// ZeroOptions::grid (embedding). As Megatron does, the two gradients are summed before the update,
// so both copies take the same step from the same state and stay equal (they start equal: the
// engine copies the first stage's values at construction). With ZeRO the stages' shards of the
// parameter cover different ranges (their layouts differ), so each rank of the 2d-rank group
// writes its pieces at their offsets in a zeroed buffer of the whole parameter (replicated plans:
// data-parallel rank 0 alone, every rank holding all of it; hybrid sharding: the first replica's
// shard group alone, the others holding the same shards), one all-reduce sums them, and each rank
// reads its pieces back. Cost: a buffer of the shared parameters' size during step() and one
// all-reduce of it. The norm counts the sum on the first stage only.
void FinalizeGrads::set_pipeline_shared(CommunicatorPtr group, std::vector<char> shared,
                                        bool contributes, bool counts) {
  shared_group_ = std::move(group);
  shared_ = std::move(shared);
  contributes_ = contributes;
  counts_ = counts;
  shared_at_.assign(shared_.size(), -1);
  shared_numel_ = 0;
  for (size_t i = 0; i < shared_.size(); ++i) {
    if (!shared_[i]) continue;
    shared_at_[i] = shared_numel_;
    shared_numel_ += flat_.layout().slots[i].numel;
  }
}

FiniteScan FinalizeGrads::run(bool norm) {
  if (!shared_group_ || shared_numel_ == 0) return {};
  auto& segments = flat_.segments();
  at::Tensor sum = at::zeros({shared_numel_}, segments.front().grad.options());
  FiniteScan before, after;
  const auto each_piece = [&](auto&& fn) {
    for (auto& s : segments) {
      for_each_param_piece(flat_.layout(), s,
                           [&](int param, int64_t begin, int64_t length, int64_t offset) {
                             if (!shared_[param]) return;
                             fn(s.grad.narrow(0, begin, length),
                                sum.narrow(0, shared_at_[param] + offset, length));
                           });
    }
  };
  each_piece([&](const at::Tensor& grad, const at::Tensor& into) {
    add_scan(before, scan_local(grad, 1.0, norm));
    if (contributes_) into.copy_(grad);
  });
  shared_group_->all_reduce(sum, ReduceOp::Sum, true)->wait(timeout_);
  each_piece([&](const at::Tensor& grad, const at::Tensor& from) {
    grad.copy_(from);
    add_scan(after, scan_local(grad, 1.0, norm));
  });
  // The first stage counts the sum; the last stage's own gradient no longer counts anywhere.
  return {after.non_finite, (counts_ ? after.sum_sq : 0.0) - before.sum_sq};
}

}  // namespace shardopt::detail
