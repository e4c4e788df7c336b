// The single-process reference the multi-rank tests compare against: training on whole global
// batches (every micro-batch of a step at once) with a torch optimizer or a reference rule.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/utils/clip_grad.h>

#include <cstdint>
#include <vector>

namespace shardopt::test {

// `steps` steps over `params`: gradients zeroed (parameters without a gradient count as zero),
// loss(x, y) on the concatenated micro-batches batch(s, 0..accumulation-1) backward, the global
// norm clipped to `clip` (0: not), then step(s).
template <typename Loss, typename Batch, typename Step>
void train_reference_loop(const std::vector<at::Tensor>& params, int64_t steps, int accumulation,
                          double clip, Loss&& loss, Batch&& batch, Step&& step) {
  for (int64_t s = 0; s < steps; ++s) {
    for (auto p : params) p.mutable_grad() = at::zeros_like(p);
    std::vector<at::Tensor> xs, ys;
    for (int m = 0; m < accumulation; ++m) {
      auto [x, y] = batch(s, m);
      xs.push_back(x);
      ys.push_back(y);
    }
    loss(at::cat(xs), at::cat(ys)).backward();
    if (clip > 0) torch::nn::utils::clip_grad_norm_(params, clip);
    step(s);
  }
}

}  // namespace shardopt::test
