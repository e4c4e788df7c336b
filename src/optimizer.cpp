// DistributedOptimizer: the torch::optim::Optimizer face of the engine (src/engine/engine.hpp),
// and weight_decay_groups.
#include "shardopt/optimizer.hpp"

#include "engine/engine.hpp"
#include "engine/group_options.hpp"
#include "shardopt/detail/rule_traits.hpp"
#include "shardopt/error.hpp"

#include <unordered_map>

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
  const std::vector<ParamGroup> given = groups;  // tensors are shared, not copied
  engine_ = std::make_unique<detail::Engine>(*this, std::move(groups), rule, nullptr,
                                             std::move(comm), options);
  register_groups(given);
}

DistributedOptimizer::DistributedOptimizer(std::vector<ParamGroup> groups,
                                           ShardOptimizerFactory factory, CommunicatorPtr comm,
                                           ZeroOptions options)
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                               defaults_of(SGD(0.0))) {
  SHARDOPT_CHECK(factory != nullptr, InvalidArgument, "optimizer: the factory is empty");
  const std::vector<ParamGroup> given = groups;
  engine_ = std::make_unique<detail::Engine>(*this, std::move(groups), SGD(0.0),
                                             std::move(factory), std::move(comm), options);
  register_groups(given);
  // LR schedulers read and write our groups: start them at the torch optimizer's own lr.
  try {
    factory_lr_ = engine_->factory_optimizer()->param_groups().at(0).options().get_lr();
  } catch (const std::exception&) {
    factory_lr_ = -1.0;  // its options do not implement get_lr: LR changes cannot reach it
  }
  if (factory_lr_ >= 0) {
    for (auto& group : param_groups()) group.options().set_lr(factory_lr_);
  }
}

// The torch param groups (trainable parameters, tied ones once) and, for state dicts, every
// parameter as given with its slot in the layout.
void DistributedOptimizer::register_groups(const std::vector<ParamGroup>& groups) {
  const auto& model = engine_->model();
  for (size_t g = 0; g < model.torch_groups.size(); ++g) {
    torch::optim::OptimizerParamGroup group(model.torch_groups[g],
                                            defaults_of(model.group_rules[g]));
    torch::optim::Optimizer::add_param_group(group);
    // Recent torch merges a group's options with the optimizer's defaults, taking the defaults
    // wherever a value equals the options class's constructor default (an explicit
    // weight_decay(0.01) for AdamW is lost that way): the group keeps exactly its own.
    param_groups().back().set_options(defaults_of(model.group_rules[g]));
  }
  std::unordered_map<const c10::TensorImpl*, int> slot;
  for (size_t i = 0; i < model.params.size(); ++i) {
    slot.emplace(model.params[i].tensor.unsafeGetTensorImpl(), static_cast<int>(i));
  }
  for (const auto& group : groups) {
    given_.emplace_back();
    for (const auto& p : group.params) {
      auto it = slot.find(p.tensor.unsafeGetTensorImpl());
      given_.back().push_back({p.name, it == slot.end() ? -1 : it->second});
    }
  }
}

void DistributedOptimizer::add_param_group(const torch::optim::OptimizerParamGroup&) {
  SHARDOPT_FAIL(InvalidArgument,
                "optimizer: add_param_group after construction is not supported: parameter "
                "groups decide the flat layout every rank shares; pass every group to the "
                "DistributedOptimizer constructor (or build a new one)");
}

// Torch's add_param_group is not virtual: a group added through the base is caught here.
void DistributedOptimizer::check_groups_unchanged() const {
  const auto& torch_groups = engine_->model().torch_groups;
  bool same = param_groups().size() == torch_groups.size();
  for (size_t g = 0; same && g < torch_groups.size(); ++g) {
    same = param_groups()[g].params().size() == torch_groups[g].size();
  }
  SHARDOPT_CHECK(same, InvalidArgument,
                 "optimizer: the parameter groups changed after construction (add_param_group "
                 "through torch::optim::Optimizer?): {} groups now, {} at construction; groups "
                 "decide the flat layout every rank shares, pass them all to the constructor",
                 param_groups().size(), torch_groups.size());
}

// A factory-built torch optimizer has its own groups: LR changes made to ours (schedulers,
// set_lr) are handed to every one of its groups.
void DistributedOptimizer::push_factory_lr() {
  torch::optim::Optimizer* inner = engine_->factory_optimizer();
  if (inner == nullptr || factory_lr_ < 0) return;
  const double lr = param_groups()[0].options().get_lr();
  for (const auto& group : param_groups()) {
    SHARDOPT_CHECK(group.options().get_lr() == lr, InvalidArgument,
                   "optimizer: parameter groups disagree on lr ({} vs {}), but a factory-built "
                   "optimizer has one lr for the whole shard", lr, group.options().get_lr());
  }
  if (lr == factory_lr_) return;
  for (auto& group : inner->param_groups()) group.options().set_lr(lr);
  factory_lr_ = lr;
}

DistributedOptimizer::~DistributedOptimizer() = default;

namespace detail {
ShardAccess& shard_access(DistributedOptimizer& optimizer) {
  return optimizer.engine_->checkpoint_access();
}
}  // namespace detail

at::Tensor DistributedOptimizer::step(LossClosure closure) {
  check_groups_unchanged();
  push_factory_lr();
  return engine_->step(closure);
}
void DistributedOptimizer::zero_grad(bool /*set_to_none*/) { engine_->zero_grad(); }
void DistributedOptimizer::backward(const at::Tensor& loss) { engine_->backward(loss); }
void DistributedOptimizer::as_one_backward(const std::function<void()>& fn) {
  engine_->as_one_backward(fn);
}
void DistributedOptimizer::begin_pipeline(int chunks, int microbatches) {
  engine_->begin_pipeline(chunks, microbatches);
}
void DistributedOptimizer::chunk_backward(int chunk, bool last,
                                          const std::function<void()>& pass) {
  engine_->chunk_backward(chunk, last, pass);
}
void DistributedOptimizer::end_pipeline() { engine_->end_pipeline(); }
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
