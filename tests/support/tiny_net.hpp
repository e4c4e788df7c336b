// TinyNet: the small model the multi-rank stage tests train (a tied weight, a frozen parameter, one
// that never gets a gradient, a 1-element group and two stage-3 units), its deterministic batches
// and rules, shared by stages_dist_test.cpp and nonfinite_dist_test.cpp.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "shardopt/optimizer.hpp"
#include "shardopt/units.hpp"

namespace shardopt::test {

constexpr int64_t kVocab = 11, kDim = 6, kHidden = 7, kBatch = 12, kSteps = 10;

// Parameters by name, in registration order; "decoder.weight" is the same tensor as
// "embed.weight". Built from a fixed seed so every rank and the reference start equal.
struct TinyNet {
  std::vector<std::pair<std::string, at::Tensor>> named;
  std::map<std::string, at::Tensor> by_name;
  UnitsPtr units = std::make_shared<Units>();

  explicit TinyNet(bool wider_fc1 = false) {
    // A generator of its own: thread-ranks share torch's default one (support/dist_env.hpp).
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1234);
    auto randn = [&](at::IntArrayRef sizes) { return at::randn(sizes, gen); };
    add("embed.weight", randn({kVocab, kDim}));
    add("fc1.weight", randn({kDim, kHidden + (wider_fc1 ? 1 : 0)}) * 0.5);
    add("fc1.bias", randn({kHidden + (wider_fc1 ? 1 : 0)}) * 0.1);
    add("fc2.weight", randn({kHidden, kDim}) * 0.5);
    add("fc2.bias", randn({kDim}) * 0.1);
    add("frozen.scale", randn({kDim}), /*trainable=*/false);
    add("unused.weight", randn({3}));
    add("tiny.bias", randn({1}));
    named.emplace_back("decoder.weight", by_name["embed.weight"]);  // tied
    units->add("fc1", {by_name["fc1.weight"], by_name["fc1.bias"]});
    units->add("fc2", {by_name["fc2.weight"], by_name["fc2.bias"]});
  }
  void add(const std::string& name, at::Tensor t, bool trainable = true) {
    t = t.contiguous().set_requires_grad(trainable);
    named.emplace_back(name, t);
    by_name[name] = t;
  }
  // Mixed precision: parameters are fp16/bf16; compute in fp32 (CPU has few fp16 kernels).
  bool upcast = false;
  at::Tensor loss(const at::Tensor& x, const at::Tensor& y) {
    auto p = [&](const char* name) {  // read inside the unit that owns the parameter
      return upcast ? by_name[name].to(at::kFloat) : by_name[name];
    };
    at::Tensor h = at::embedding(p("embed.weight"), x);
    h = units->run(0, [&] {
      return at::tanh(at::matmul(h, p("fc1.weight").narrow(1, 0, kHidden)) +
                      p("fc1.bias").narrow(0, 0, kHidden));
    });
    h = units->run(1, [&] { return at::matmul(h, p("fc2.weight")) + p("fc2.bias"); });
    h = h + p("frozen.scale") + p("tiny.bias");
    at::Tensor logits = at::matmul(h, p("embed.weight").t());
    return at::nll_loss(at::log_softmax(logits, 1), y);
  }
  // Three groups: weights (default rule); biases (no weight decay, their own lr); and tiny.bias
  // alone, a group of one element (fewer than the ranks: most ranks own only padding of it).
  std::vector<ParamGroup> groups(bool split) {
    std::vector<ParamGroup> out(split ? 3 : 1);
    for (auto& [name, t] : named) {
      const bool bias = name.find("bias") != std::string::npos;
      const int g = !split ? 0 : name == "tiny.bias" ? 2 : bias ? 1 : 0;
      out[g].params.push_back({name, t});
    }
    if (split) {
      out[1].weight_decay = 0.0;
      out[1].lr = 0.02;
      out[2].lr = 0.03;
    }
    return out;
  }
};

// Deterministic global batch of step s, micro-batch m.
inline std::pair<at::Tensor, at::Tensor> batch(int64_t s, int64_t m) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1000 + s * 16 + m);
  return {at::randint(kVocab, {kBatch}, gen, at::kLong), at::randint(kVocab, {kBatch}, gen, at::kLong)};
}

inline Rule make_rule(const std::string& name) {
  if (name == "adamw") return AdamW(0.01).weight_decay(0.05);
  if (name == "adam") return Adam(0.01).weight_decay(0.01).amsgrad(true);
  if (name == "sgd") return SGD(0.05).momentum(0.9).dampening(0.1).weight_decay(0.01);
  if (name == "nesterov") return SGD(0.05).momentum(0.9).nesterov(true);
  if (name == "adagrad") return Adagrad(0.05).lr_decay(0.01).initial_accumulator_value(0.1).weight_decay(0.01);
  if (name == "rmsprop") return RMSprop(0.01).momentum(0.5).centered(true).weight_decay(0.01);
  if (name == "lamb") return Lamb(0.01).weight_decay(0.01);
  throw std::runtime_error("unknown rule " + name);
}

inline double max_abs_diff(const std::map<std::string, at::Tensor>& a,
                    const std::map<std::string, at::Tensor>& b, std::string* worst) {
  double d = 0;
  for (auto& [name, t] : a) {
    const double di = (t - b.at(name)).abs().max().item<double>();
    if (di > d) {
      d = di;
      *worst = name;
    }
  }
  return d;
}

}  // namespace shardopt::test
