// GroupOptions: the options of one torch param group DistributedOptimizer registers. It holds the
// group's rule, so torch LR schedulers (set_lr) are seen by the next step and checkpoints read and
// write the rule where the torch optimizer keeps it.
#pragma once

#include <torch/optim/optimizer.h>

#include "shardopt/rules.hpp"

namespace shardopt::detail {

class GroupOptions : public torch::optim::OptimizerCloneableOptions<GroupOptions> {
 public:
  explicit GroupOptions(Rule rule) : rule(std::move(rule)) {}
  double get_lr() const override { return rule_lr(rule); }
  void set_lr(const double lr) override { set_rule_lr(rule, lr); }
  Rule rule;
};

// The rule of torch param group `group` of `owner` (a DistributedOptimizer).
inline Rule& group_rule_of(torch::optim::Optimizer& owner, int group) {
  return static_cast<GroupOptions&>(owner.param_groups()[group].options()).rule;
}
inline const Rule& group_rule_of(const torch::optim::Optimizer& owner, int group) {
  return static_cast<const GroupOptions&>(owner.param_groups()[group].options()).rule;
}

}  // namespace shardopt::detail
