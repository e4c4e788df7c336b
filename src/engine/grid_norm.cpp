// GridNorm: the gradient norm and the non-finite flag over the model-parallel grid.
#include "engine/grid_norm.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>

#include "engine/model_check.hpp"
#include "shardopt/tensor_parallel.hpp"

#include "shardopt/error.hpp"

namespace shardopt::detail {

// Note [Split records]: as Megatron counts every parameter without tensor_model_parallel once,
// a parameter with no split (marked replicated, sequence parallel, or never marked) is held whole
// by every tensor rank.
TensorGrid tensor_grid_of(const std::vector<ModelParam>& params, CommunicatorPtr given) {
  TensorGrid grid{std::move(given), std::vector<char>(params.size(), 1)};
  std::vector<std::optional<tp::SplitRecord>> records;
  for (const auto& p : params) records.push_back(tp::record_of(p.tensor));
  if (!grid.group) {
    for (const auto& r : records) {
      if (r && r->split && r->group->size() > 1) {
        grid.group = r->group;
        break;
      }
    }
  }
  if (!grid.group) return {};
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& r = records[i];
    if (!r) continue;
    SHARDOPT_CHECK(r->group->size() == grid.group->size(), InvalidArgument,
                   "optimizer: parameter '{}' is marked {} over a tensor group of {} rank(s), "
                   "expected the optimizer's tensor group of {} (ZeroOptions::tensor_group, or "
                   "that of the other split parameters)",
                   params[i].name, r->split ? "split" : "replicated", r->group->size(),
                   grid.group->size());
    grid.replicated[i] = r->split ? 0 : 1;
  }
  return grid;
}

void GridNorm::set_tensor_group(CommunicatorPtr group, std::vector<char> replicated) {
  tensor_group_ = std::move(group);
  replicated_ = std::move(replicated);
}

// Note [Parameters shared by two stages]
// The tied word embedding lives on the first pipeline stage (the lookup) and on the last (the
// decoder); each stage's optimizer holds a copy and its own gradient. As Megatron does, the two
// gradients are summed before the update, so both copies take the same step from the same state
// and stay equal (they start equal: the engine copies the first stage's values at construction).
// The sum happens here, after the reduction over the data-parallel group and the unscale: with
// ZeRO the stages' shards of the parameter cover different ranges (their layouts differ), so each
// rank of the 2d-rank group writes its pieces at their offsets in a zeroed buffer of the whole
// parameter (replicated plans: data-parallel rank 0 alone, every rank holding all of it; hybrid
// sharding: the first replica's shard group alone, the others holding the same shards), one
// all-reduce sums them, and each rank reads its pieces back. Cost: a buffer of the shared
// parameters' size during step() and one all-reduce of it. The norm counts the sum on the first
// stage only.
void GridNorm::set_pipeline(CommunicatorPtr pipeline, CommunicatorPtr shared_group,
                            std::vector<char> shared, bool contributes) {
  contributes_ = contributes;
  pipeline_group_ = std::move(pipeline);
  shared_group_ = std::move(shared_group);
  shared_ = std::move(shared);
  shared_at_.assign(shared_.size(), -1);
  shared_numel_ = 0;
  for (size_t i = 0; i < shared_.size(); ++i) {
    if (!shared_[i]) continue;
    shared_at_[i] = shared_numel_;
    shared_numel_ += flat_.layout().slots[i].numel;
  }
}

FiniteScan GridNorm::combine(FiniteScan local, bool norm) {
  if (shared_group_ && shared_numel_ > 0) {
    const FiniteScan change = sum_shared(norm);
    local.non_finite = local.non_finite || change.non_finite;
    local.sum_sq = std::max(0.0, local.sum_sq + change.sum_sq);  // clamped as below
  }
  // Tensor parallelism: each tensor rank holds the replicated parameters' gradients whole, so
  // they count 1/t on each (clamped: the two sums round differently).
  if (tensor_group_ && norm) {
    const double t = tensor_group_->size();
    local.sum_sq = std::max(0.0, local.sum_sq - (1.0 - 1.0 / t) * replicated_sum_sq());
  }
  // Replicated plans hold the same reduced gradients on every rank: the answers agree already.
  auto scan = agree_on(local, norm, flat_.plan().sharded() ? comm_.get() : nullptr, timeout_);
  if (tensor_group_) scan = agree_on(scan, norm, tensor_group_.get(), timeout_);
  if (pipeline_group_) scan = agree_on(scan, norm, pipeline_group_.get(), timeout_);
  return scan;
}

double GridNorm::replicated_sum_sq() const {
  double sum = 0.0;
  for (const auto& s : flat_.segments()) {
    for_each_param_piece(flat_.layout(), s, [&](int param, int64_t begin, int64_t length, int64_t) {
      if (!replicated_[param]) return;
      sum += s.grad.narrow(0, begin, length).to(at::kDouble).pow(2).sum().item<double>();
    });
  }
  return sum;
}

// Note [Parameters shared by two stages].
FiniteScan GridNorm::sum_shared(bool norm) {
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
  const bool counts = pipeline_group_->rank() == 0;
  return {after.non_finite, (counts ? after.sum_sq : 0.0) - before.sum_sq};
}

}  // namespace shardopt::detail
