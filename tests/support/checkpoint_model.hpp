// A tiny model for checkpoint tests (one process and mpirun): a tied weight, a frozen parameter,
// one that never gets a gradient, a 1-element parameter, and two parameter groups with their own
// hyper-parameters. Every rank feeds its slice of a deterministic global batch per step.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "shardopt/optimizer.hpp"
#include "shardopt/units.hpp"

namespace shardopt::test {

constexpr int64_t kCkptVocab = 11, kCkptDim = 6, kCkptBatch = 12;

struct CkptNet {
  std::vector<std::pair<std::string, at::Tensor>> named;
  std::map<std::string, at::Tensor> by_name;
  int64_t hidden;

  // `hidden` and `fc1_name` change the model, for "checkpoint of another model" tests.
  explicit CkptNet(int64_t hidden = 7, const std::string& fc1_name = "fc1.weight")
      : hidden(hidden) {
    at::manual_seed(4321);
    add("embed.weight", at::randn({kCkptVocab, kCkptDim}));
    add(fc1_name, at::randn({kCkptDim, hidden}) * 0.5);
    add("fc1.bias", at::randn({hidden}) * 0.1);
    add("fc2.weight", at::randn({hidden, kCkptDim}) * 0.5);
    add("fc2.bias", at::randn({kCkptDim}) * 0.1);
    add("frozen.scale", at::randn({kCkptDim}), /*trainable=*/false);
    add("unused.weight", at::randn({3}));
    add("tiny.bias", at::randn({1}));
    named.emplace_back("decoder.weight", by_name["embed.weight"]);  // tied
    fc1 = fc1_name;
    units->add("fc1", {by_name[fc1_name], by_name["fc1.bias"]});
    units->add("fc2", {by_name["fc2.weight"], by_name["fc2.bias"]});
  }
  void add(const std::string& name, at::Tensor t, bool trainable = true) {
    t = t.contiguous().set_requires_grad(trainable);
    named.emplace_back(name, t);
    by_name[name] = t;
  }
  // Stage 3 units (fc1, fc2; the rest in no unit); `upcast` computes in fp32 from fp16/bf16
  // parameters (CPU has few fp16 kernels).
  UnitsPtr units = std::make_shared<Units>();
  bool upcast = false;
  at::Tensor loss(const at::Tensor& x, const at::Tensor& y) {
    auto p = [&](const std::string& name) {
      return upcast ? by_name[name].to(at::kFloat) : by_name[name];
    };
    at::Tensor h = at::embedding(p("embed.weight"), x);
    h = units->run(0, [&] { return at::tanh(at::matmul(h, p(fc1)) + p("fc1.bias")); });
    h = units->run(1, [&] { return at::matmul(h, p("fc2.weight")) + p("fc2.bias"); });
    h = h + p("frozen.scale") + p("tiny.bias");
    return at::nll_loss(at::log_softmax(at::matmul(h, p("embed.weight").t()), 1), y);
  }
  // Weights (the rule's own hyper-parameters) and biases (no weight decay, their own lr).
  std::vector<ParamGroup> groups() {
    std::vector<ParamGroup> out(2);
    for (auto& [name, t] : named) {
      out[name.find("bias") != std::string::npos ? 1 : 0].params.push_back({name, t});
    }
    out[1].weight_decay = 0.0;
    out[1].lr = 0.02;
    return out;
  }
  std::map<std::string, at::Tensor> snapshot() const {
    std::map<std::string, at::Tensor> out;
    for (const auto& [name, t] : named) out[name] = t.detach().to(at::kFloat, false, true);
    return out;
  }
  std::string fc1;
};

inline Rule ckpt_rule(const std::string& name) {
  if (name == "adamw") return AdamW(0.01).weight_decay(0.05);
  if (name == "adam") return Adam(0.01).weight_decay(0.01).amsgrad(true);
  if (name == "sgd") return SGD(0.05).momentum(0.9).dampening(0.1).weight_decay(0.01);
  if (name == "adagrad") return Adagrad(0.05).lr_decay(0.01).initial_accumulator_value(0.1);
  if (name == "rmsprop") return RMSprop(0.01).momentum(0.5).centered(true).weight_decay(0.01);
  if (name == "lamb") return Lamb(0.01).weight_decay(0.01);
  throw std::runtime_error("unknown rule " + name);
}

// Optimizer steps [from, to) on this rank's slice of each global batch.
inline void ckpt_train(DistributedOptimizer& opt, CkptNet& net, int64_t from, int64_t to) {
  const int rank = opt.communicator()->rank(), world = opt.communicator()->size();
  const int64_t per_rank = kCkptBatch / world;
  for (int64_t s = from; s < to; ++s) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(500 + s);
    at::Tensor x = at::randint(kCkptVocab, {kCkptBatch}, gen, at::kLong);
    at::Tensor y = at::randint(kCkptVocab, {kCkptBatch}, gen, at::kLong);
    opt.zero_grad();
    opt.backward(
        net.loss(x.narrow(0, rank * per_rank, per_rank), y.narrow(0, rank * per_rank, per_rank)));
    opt.step();
  }
}

// Largest absolute difference over parameters present in both; `worst` names it.
inline double ckpt_max_diff(const std::map<std::string, at::Tensor>& a,
                            const std::map<std::string, at::Tensor>& b, std::string* worst) {
  double d = 0;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end()) return 1e30;
    const double di = (t - it->second).abs().max().item<double>();
    if (di > d) {
      d = di;
      if (worst) *worst = name;
    }
  }
  return d;
}

inline bool ckpt_bitwise_equal(const std::map<std::string, at::Tensor>& a,
                               const std::map<std::string, at::Tensor>& b, std::string* worst) {
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end() || !t.equal(it->second)) {
      if (worst) *worst = name;
      return false;
    }
  }
  return a.size() == b.size();
}

}  // namespace shardopt::test
