// FinalizeGrads: the sums over the model-parallel grid between the reduction and the update.
#include "engine/finalize_grads.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <functional>
#include <string>

#include "shardopt/error.hpp"

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
namespace {

// Per slot: its offset in a buffer of the flagged slots laid end to end (-1 if not flagged);
// returns the buffer's size.
int64_t place_slots(const FlatLayout& layout, const std::vector<char>& slots,
                    std::vector<int64_t>& at) {
  at.assign(slots.size(), -1);
  int64_t numel = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (!slots[i]) continue;
    at[i] = numel;
    numel += layout.slots[i].numel;
  }
  return numel;
}

}  // namespace

void FinalizeGrads::set_pipeline_shared(CommunicatorPtr group, std::vector<char> shared,
                                        bool contributes, bool counts) {
  shared_group_ = std::move(group);
  shared_ = std::move(shared);
  contributes_ = contributes;
  counts_ = counts;
  shared_numel_ = place_slots(flat_.layout(), shared_, shared_at_);
}

void FinalizeGrads::set_sequence_parallel(CommunicatorPtr tensor_group, std::vector<char> slots) {
  tensor_group_ = std::move(tensor_group);
  sequence_ = std::move(slots);
  sequence_numel_ = place_slots(flat_.layout(), sequence_, sequence_at_);
  // Every rank writes its pieces where they sit in the whole parameters, so the sum is right only
  // if the tensor ranks hold the same pieces: true when their layouts are equal, checked here.
  std::string pieces;
  for (auto& s : flat_.segments()) {
    for_each_param_piece(flat_.layout(), s,
                         [&](int param, int64_t, int64_t length, int64_t offset) {
                           if (sequence_[param]) pieces += fmt::format("{}:{}+{},", param, offset, length);
                         });
  }
  const auto digest = static_cast<double>(std::hash<std::string>{}(pieces) >> 12);
  at::Tensor range = at::tensor({digest, -digest}, at::kDouble);
  tensor_group_->all_reduce(range, ReduceOp::Max, true)->wait(timeout_);
  SHARDOPT_CHECK(range[0].item<double>() == -range[1].item<double>(), InvalidArgument,
                 "optimizer: the ranks of the tensor group hold different pieces of the "
                 "sequence-parallel parameters (their flat layouts differ: the same model and "
                 "ZeroOptions on every tensor rank are needed), so their gradients cannot be "
                 "summed (Note [Sequence-parallel sums])");
}

void FinalizeGrads::sum_pieces(const CommunicatorPtr& group, const std::vector<char>& slots,
                               const std::vector<int64_t>& at, int64_t numel, bool contributes,
                               bool norm, FiniteScan& before, FiniteScan& after) {
  auto& segments = flat_.segments();
  at::Tensor sum = at::zeros({numel}, segments.front().grad.options());
  const auto each_piece = [&](auto&& fn) {
    for (auto& s : segments) {
      for_each_param_piece(flat_.layout(), s,
                           [&](int param, int64_t begin, int64_t length, int64_t offset) {
                             if (!slots[param]) return;
                             fn(s.grad.narrow(0, begin, length),
                                sum.narrow(0, at[param] + offset, length));
                           });
    }
  };
  each_piece([&](const at::Tensor& grad, const at::Tensor& into) {
    add_scan(before, scan_local(grad, 1.0, norm));
    if (contributes) into.copy_(grad);
  });
  group->all_reduce(sum, ReduceOp::Sum, true)->wait(timeout_);
  each_piece([&](const at::Tensor& grad, const at::Tensor& from) {
    grad.copy_(from);
    add_scan(after, scan_local(grad, 1.0, norm));
  });
}

FiniteScan FinalizeGrads::run(bool norm) {
  FiniteScan change;
  if (tensor_group_ && sequence_numel_ > 0) {
    FiniteScan before, after;
    sum_pieces(tensor_group_, sequence_, sequence_at_, sequence_numel_, true, norm, before, after);
    change.non_finite = after.non_finite;
    change.sum_sq = after.sum_sq - before.sum_sq;
  }
  if (shared_group_ && shared_numel_ > 0) {
    FiniteScan before, after;
    sum_pieces(shared_group_, shared_, shared_at_, shared_numel_, contributes_, norm, before,
               after);
    // The first stage counts the sum; the last stage's own gradient no longer counts anywhere.
    change.non_finite = change.non_finite || after.non_finite;
    change.sum_sq += (counts_ ? after.sum_sq : 0.0) - before.sum_sq;
  }
  return change;
}

}  // namespace shardopt::detail
