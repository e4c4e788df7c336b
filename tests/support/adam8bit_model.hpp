// The model of the 8-bit AdamW tests (tests/dist/adam8bit_dist_test.cpp and
// adam8bit_checkpoint_dist_test.cpp): parameters over and under the 4096-element threshold with
// short last blocks, two groups, and dyadic gradients that are the same on every rank, so the
// averaged gradient is exact whatever the number of ranks.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "shardopt/optimizer.hpp"

namespace shardopt::test::adam8bit {

struct Shape {
  const char* name;
  std::vector<int64_t> sizes;
  int group;
};
// Over the threshold: 5200 and 6300 elements (short last blocks), 4096 (exactly the threshold);
// under it: 70, 300 and 4095.
inline const std::vector<Shape> kShapes = {
    {"embed.weight", {40, 130}, 0}, {"proj.weight", {70, 90}, 0}, {"proj.bias", {70}, 1},
    {"head.weight", {4096}, 0},     {"norm.scale", {300}, 1},     {"gate.weight", {4095}, 0}};

// Dyadic gradient of parameter `p` at `step`: an integer of -1001..1001 times a power of two from
// 2^-40 to 2^-16 that changes from block to block (and every 10 steps), so blocks differ by
// decades; some blocks all zero at some steps. (A spread of 2^24 inside one block, as an earlier
// version had, loses small second moments to the zero code and moves such elements by far more
// than lr per step: blockwise 8-bit state assumes comparable magnitudes within a block.)
inline at::Tensor gradient(int64_t p, int64_t step, int64_t n) {
  std::vector<float> g(n);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = (static_cast<uint64_t>(i) * 2654435761u + step * 40503u + p * 977u) % 2003u;
    const int e = 6 + static_cast<int>(((i / 256) * 7 + p + step / 10) % 25);
    g[i] = std::ldexp(static_cast<float>(static_cast<int64_t>(h) - 1001), -e - 10);
    if ((i / 256 + p) % 11 == 3 && step % 3 == 0) g[i] = 0.0f;
  }
  return at::tensor(g);
}

struct Net {
  std::vector<at::Tensor> params;
  Net() {
    for (size_t p = 0; p < kShapes.size(); ++p) {
      int64_t n = 1;
      for (int64_t d : kShapes[p].sizes) n *= d;
      params.push_back(
          (at::arange(n, at::kFloat).mul(0.37).add(static_cast<double>(p)).sin().mul(0.5))
              .reshape(kShapes[p].sizes)
              .set_requires_grad(true));
    }
  }
  std::vector<ParamGroup> groups() {
    ParamGroup g0, g1;
    g1.lr = 3e-3;
    g1.weight_decay = 0.0;
    for (size_t p = 0; p < kShapes.size(); ++p) {
      (kShapes[p].group == 0 ? g0 : g1).params.push_back({kShapes[p].name, params[p]});
    }
    return {g0, g1};
  }
  // sum_p (G_p * p).sum(): the gradient is G exactly, on every rank.
  at::Tensor loss(int64_t step) {
    at::Tensor total = at::zeros({}, at::kFloat);
    for (size_t p = 0; p < params.size(); ++p) {
      total = total + (gradient(static_cast<int64_t>(p), step, params[p].numel())
                           .reshape(params[p].sizes()) * params[p]).sum();
    }
    return total;
  }
};

inline AdamW8bit rule() {
  return AdamW8bit(1e-2).beta1(0.9).beta2(0.995).eps(1e-8).weight_decay(0.05);
}

}  // namespace shardopt::test::adam8bit
