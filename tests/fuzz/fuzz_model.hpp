// The tiny model the optimizer-state harnesses load into (and their seed writer saves from): a
// tied weight, a frozen parameter and two groups, as CkptNet (tests/support/checkpoint_model.hpp)
// but small enough that a whole checkpoint directory fits the fuzzers' -max_len.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "shardopt/checkpoint.hpp"
#include "shardopt/optimizer.hpp"

namespace shardopt::fuzz {

// Rules by a flag's value: their state buffers differ (SGD with momentum keeps one, Adam with
// amsgrad three), so an archive of one read into another is a Mismatch to reach too.
inline Rule fuzz_rule(int index) {
  switch (index % 4) {
    case 0: return AdamW(0.01).weight_decay(0.05);
    case 1: return SGD(0.05).momentum(0.9);
    case 2: return Adagrad(0.05).initial_accumulator_value(0.1);
    default: return Adam(0.01).amsgrad(true);
  }
}

struct FuzzNet {
  at::Tensor w = (at::arange(12, at::kFloat).view({4, 3}) * 0.1).set_requires_grad(true);
  at::Tensor b = (at::arange(3, at::kFloat) * 0.01).set_requires_grad(true);
  at::Tensor frozen = at::ones({2});

  // Group 0: the weight, its tied second name and the frozen scale; group 1: the bias.
  std::vector<ParamGroup> groups() const {
    std::vector<ParamGroup> g(2);
    g[0].params = {{"embed.weight", w}, {"decoder.weight", w}, {"frozen.scale", frozen}};
    g[1].params = {{"fc.bias", b}};
    g[1].lr = 0.02;
    g[1].weight_decay = 0.0;
    return g;
  }
  std::unique_ptr<DistributedOptimizer> optimizer(int rule, int stage) const {
    ZeroOptions zo;
    zo.stage = stage_from_int(stage);
    zo.bucket_bytes = 32;  // several buckets: the weight is split across two
    return std::make_unique<DistributedOptimizer>(groups(), fuzz_rule(rule),
                                                  make_single_communicator(), zo);
  }
  void train(DistributedOptimizer& opt, int steps) const {
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      opt.backward((w.sum(0) * b).sum() + (w * w).sum() * 0.1 + b.sum());
      opt.step();
    }
  }
  // LoadOptions::module_state / SaveOptions for the frozen scale.
  std::map<std::string, at::Tensor> module_state() const { return {{"frozen.scale", frozen}}; }
};

}  // namespace shardopt::fuzz
