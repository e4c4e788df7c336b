// Hyper-parameters of the optimizers DistributedOptimizer runs natively over its shard. Light
// structs (no torch/optim headers); fluent like torch's options: AdamW(1e-4).weight_decay(0.01).
// Defaults equal torch's.
#pragma once

#include <string>
#include <variant>

#define SHARDOPT_ARG(T, name, init)                 \
 public:                                            \
  auto& name(const T& value) {                      \
    name##_ = value;                                \
    return *this;                                   \
  }                                                 \
  const T& name() const { return name##_; }         \
                                                    \
 private:                                           \
  T name##_ = init

namespace shardopt {

struct Adam {
  explicit Adam(double lr = 1e-3) : lr_(lr) {}
  static constexpr const char* kName = "adam";
  SHARDOPT_ARG(double, lr, 1e-3);
  SHARDOPT_ARG(double, beta1, 0.9);
  SHARDOPT_ARG(double, beta2, 0.999);
  SHARDOPT_ARG(double, eps, 1e-8);
  SHARDOPT_ARG(double, weight_decay, 0.0);  // L2 added to the gradient
  SHARDOPT_ARG(bool, amsgrad, false);
};

struct AdamW {
  explicit AdamW(double lr = 1e-3) : lr_(lr) {}
  static constexpr const char* kName = "adamw";
  SHARDOPT_ARG(double, lr, 1e-3);
  SHARDOPT_ARG(double, beta1, 0.9);
  SHARDOPT_ARG(double, beta2, 0.999);
  SHARDOPT_ARG(double, eps, 1e-8);
  SHARDOPT_ARG(double, weight_decay, 1e-2);  // decoupled
  SHARDOPT_ARG(bool, amsgrad, false);
};

struct SGD {
  explicit SGD(double lr) : lr_(lr) {}
  static constexpr const char* kName = "sgd";
  SHARDOPT_ARG(double, lr, 0.0);
  SHARDOPT_ARG(double, momentum, 0.0);
  SHARDOPT_ARG(double, dampening, 0.0);
  SHARDOPT_ARG(double, weight_decay, 0.0);
  SHARDOPT_ARG(bool, nesterov, false);
};

struct Adagrad {
  explicit Adagrad(double lr = 1e-2) : lr_(lr) {}
  static constexpr const char* kName = "adagrad";
  SHARDOPT_ARG(double, lr, 1e-2);
  SHARDOPT_ARG(double, lr_decay, 0.0);
  SHARDOPT_ARG(double, weight_decay, 0.0);
  SHARDOPT_ARG(double, initial_accumulator_value, 0.0);
  SHARDOPT_ARG(double, eps, 1e-10);
};

struct RMSprop {
  explicit RMSprop(double lr = 1e-2) : lr_(lr) {}
  static constexpr const char* kName = "rmsprop";
  SHARDOPT_ARG(double, lr, 1e-2);
  SHARDOPT_ARG(double, alpha, 0.99);
  SHARDOPT_ARG(double, eps, 1e-8);
  SHARDOPT_ARG(double, weight_decay, 0.0);
  SHARDOPT_ARG(double, momentum, 0.0);
  SHARDOPT_ARG(bool, centered, false);
};

// LAMB (You et al. 2019): Adam's update scaled per tensor by ||w|| / ||update||. The norms span
// whole tensors, which shards split: partial sums are all-reduced, so sharded LAMB equals LAMB.
struct Lamb {
  explicit Lamb(double lr = 1e-3) : lr_(lr) {}
  static constexpr const char* kName = "lamb";
  SHARDOPT_ARG(double, lr, 1e-3);
  SHARDOPT_ARG(double, beta1, 0.9);
  SHARDOPT_ARG(double, beta2, 0.999);
  SHARDOPT_ARG(double, eps, 1e-6);
  SHARDOPT_ARG(double, weight_decay, 0.0);
};

using Rule = std::variant<Adam, AdamW, SGD, Adagrad, RMSprop, Lamb>;

// "adamw", "sgd", ... of whichever rule `rule` holds.
const char* rule_name(const Rule& rule);
double rule_lr(const Rule& rule);
void set_rule_lr(Rule& rule, double lr);
void set_rule_weight_decay(Rule& rule, double weight_decay);

}  // namespace shardopt

#undef SHARDOPT_ARG
