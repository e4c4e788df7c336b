// DistributedOptimizer: the torch::optim::Optimizer face of the engine (src/engine/engine.hpp),
// and weight_decay_groups.
#include "shardopt/optimizer.hpp"

#include "engine/engine.hpp"
#include "engine/group_options.hpp"
#include "shardopt/detail/rule_traits.hpp"
#include "shardopt/error.hpp"

namespace shardopt {

std::vector<ParamGroup> weight_decay_groups(
    const torch::OrderedDict<std::string, at::Tensor>& named_parameters,
    const std::function<bool(const std::string&)>& no_decay) {
  ParamGroup decay, plain;
  plain.weight_decay = 0.0;
  for (const auto& item : named_parameters) {
    (no_decay(item.key()) ? plain : decay).params.push_back({item.key(), item.value()});
  }
  std::vector<ParamGroup> groups;
  if (!decay.params.empty()) groups.push_back(std::move(decay));
  if (!plain.params.empty()) groups.push_back(std::move(plain));
  return groups;
}

namespace {
std::vector<ParamGroup> single_group(const torch::OrderedDict<std::string, at::Tensor>& named) {
  ParamGroup group;
  for (const auto& item : named) group.params.push_back({item.key(), item.value()});
  return {std::move(group)};
}
std::unique_ptr<torch::optim::OptimizerOptions> defaults_of(const Rule& rule) {
  return std::make_unique<detail::GroupOptions>(rule);
}
}  // namespace

DistributedOptimizer::DistributedOptimizer(
    const torch::OrderedDict<std::string, at::Tensor>& named_parameters, Rule rule,
    CommunicatorPtr comm, ZeroOptions options)
    : DistributedOptimizer(single_group(named_parameters), std::move(rule), std::move(comm),
                           options) {}

DistributedOptimizer::DistributedOptimizer(std::vector<ParamGroup> groups, Rule rule,
                                           CommunicatorPtr comm, ZeroOptions options)
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{}, defaults_of(rule)) {
  engine_ = std::make_unique<detail::Engine>(*this, std::move(groups), rule, nullptr,
                                             std::move(comm), options);
  for (size_t g = 0; g < engine_->model().torch_groups.size(); ++g) {
    torch::optim::OptimizerParamGroup group(engine_->model().torch_groups[g],
                                            defaults_of(engine_->model().group_rules[g]));
    add_param_group(group);
  }
}

DistributedOptimizer::DistributedOptimizer(std::vector<ParamGroup> groups,
                                           ShardOptimizerFactory factory, CommunicatorPtr comm,
                                           ZeroOptions options)
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                               defaults_of(SGD(0.0))) {
  SHARDOPT_CHECK(factory != nullptr, InvalidArgument, "optimizer: the factory is empty");
  engine_ = std::make_unique<detail::Engine>(*this, std::move(groups), SGD(0.0),
                                             std::move(factory), std::move(comm), options);
  for (size_t g = 0; g < engine_->model().torch_groups.size(); ++g) {
    torch::optim::OptimizerParamGroup group(engine_->model().torch_groups[g],
                                            defaults_of(engine_->model().group_rules[g]));
    add_param_group(group);
  }
}

DistributedOptimizer::~DistributedOptimizer() = default;

namespace detail {
ShardAccess& shard_access(DistributedOptimizer& optimizer) {
  return optimizer.engine_->checkpoint_access();
}
}  // namespace detail

at::Tensor DistributedOptimizer::step(LossClosure closure) { return engine_->step(closure); }
void DistributedOptimizer::zero_grad() { engine_->zero_grad(); }
void DistributedOptimizer::backward(const at::Tensor& loss) { engine_->backward(loss); }
const StepStats& DistributedOptimizer::last_step() const { return engine_->last_step(); }
MemoryReport DistributedOptimizer::memory() const { return engine_->memory(); }
const ZeroOptions& DistributedOptimizer::options() const { return engine_->options(); }
const CommunicatorPtr& DistributedOptimizer::communicator() const { return engine_->communicator(); }
int64_t DistributedOptimizer::numel() const { return engine_->numel(); }
int64_t DistributedOptimizer::padded_numel() const { return engine_->padded_numel(); }
void DistributedOptimizer::gather_full_parameters() { engine_->gather_full_parameters(); }
bool DistributedOptimizer::parameters_finite() { return engine_->parameters_finite(); }

Rule DistributedOptimizer::group_rule(size_t group) const {
  SHARDOPT_CHECK(group < param_groups().size(), InvalidArgument,
                 "optimizer: parameter group {} does not exist, there are {}", group,
                 param_groups().size());
  return detail::group_rule_of(*this, static_cast<int>(group));
}

void DistributedOptimizer::set_group_rule(size_t group, const Rule& rule) {
  SHARDOPT_CHECK(group < param_groups().size(), InvalidArgument,
                 "optimizer: parameter group {} does not exist, there are {}", group,
                 param_groups().size());
  Rule& current = detail::group_rule_of(*this, static_cast<int>(group));
  SHARDOPT_CHECK(rule.index() == current.index(), InvalidArgument,
                 "optimizer: parameter group {} steps with {}, it cannot switch to {}", group,
                 rule_name(current), rule_name(rule));
  // The state buffers were allocated for the construction-time rule: keep their number and order.
  SHARDOPT_CHECK(detail::state_names(rule) == detail::state_names(current),
                 InvalidArgument,
                 "optimizer: parameter group {}: this change to the {} hyper-parameters needs "
                 "other optimizer state than was allocated (momentum zero vs non-zero, amsgrad, "
                 "centered); set it when constructing the optimizer",
                 group, rule_name(rule));
  current = rule;
}

}  // namespace shardopt
