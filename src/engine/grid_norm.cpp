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

FiniteScan GridNorm::combine(FiniteScan local, bool norm) {
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

}  // namespace shardopt::detail
