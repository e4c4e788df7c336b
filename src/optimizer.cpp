// DistributedOptimizer: flat buffers, gradient reduction from autograd hooks, the sharded update
// and the parameter gather, for ZeRO stages 0-3.
//
// Note [Flat layout]
// Trainable parameters (deduplicated: tied weights appear once; frozen ones are left out) are
// sorted by parameter group and, within a group, placed in reverse registration order, which is
// roughly the order backward produces their gradients. They are packed into buckets of about
// bucket_bytes; each bucket is padded to a multiple of world * align so it splits evenly, and rank
// r owns [r*S, (r+1)*S) of every bucket. Model parameters become views into one flat buffer, so
// the optimizer updates them with no copy. A bucket is the unit of one collective.
//
// Note [Stages]
//   stage 0: gradients accumulate in a flat buffer (the params' .grad are views); each complete
//            bucket is all-reduced in place; every rank updates the whole buffer.
//   stage 1: same buffer, but buckets are reduce-scattered into the owned slice; each rank updates
//            its slices; then every bucket is all-gathered in place.
//   stage 2: no full gradient buffer: a hook copies each fresh .grad into a pooled bucket buffer
//            and frees it; a complete bucket is reduce-scattered and folded into the gradient
//            shard. Only the shard (and at most a few bucket buffers) live on.
//   stage 3: gradients as stage 2; parameters live as a shard buffer (the update's target). Each
//            bucket has a full buffer whose storage exists only while its unit is gathered; the
//            model's parameters stay views into it (see Note [Stage 3 units]).
// Reductions are sums; the division by world * micro-steps happens once, on the reduced values.
#include "shardopt/optimizer.hpp"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>
#include <cmath>
#include <deque>
#include <optional>
#include <unordered_map>

#include "shardopt/detail/partition.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/error.hpp"
#include "shardopt/units.hpp"
#include "kernels/fused.hpp"

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

namespace detail {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Options of one torch param group: the group's rule, so that torch LR schedulers (set_lr) are
// seen by the next step.
class GroupOptions : public torch::optim::OptimizerCloneableOptions<GroupOptions> {
 public:
  explicit GroupOptions(Rule rule) : rule(std::move(rule)) {}
  double get_lr() const override { return rule_lr(rule); }
  void set_lr(const double lr) override { set_rule_lr(rule, lr); }
  Rule rule;
};

// Number of state buffers (each one shard long) a rule keeps.
int state_count(const Rule& rule) {
  struct {
    int operator()(const Adam& r) const { return r.amsgrad() ? 3 : 2; }
    int operator()(const AdamW& r) const { return r.amsgrad() ? 3 : 2; }
    int operator()(const SGD& r) const { return r.momentum() != 0.0 ? 1 : 0; }
    int operator()(const Adagrad&) const { return 1; }
    int operator()(const RMSprop& r) const {
      return 1 + (r.momentum() > 0.0 ? 1 : 0) + (r.centered() ? 1 : 0);
    }
    int operator()(const Lamb&) const { return 2; }
  } count;
  return std::visit(count, rule);
}

// FNV-1a: a digest of parameter descriptions that is the same on every platform.
int64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return static_cast<int64_t>(h & 0x7fffffffffffffffull);
}

}  // namespace

// The torch-side elementwise update of one rule on one contiguous segment. These mirror
// torch::optim's own formulas op for op, so a segment updates exactly as torch updates the
// tensors it covers.
struct RuleStep {
  int64_t step;  // 1-based, after increment

  void operator()(const AdamW& r, at::Tensor& p, at::Tensor& g, std::vector<at::Tensor>& st) const {
    if (r.weight_decay() != 0) p.mul_(1 - r.lr() * r.weight_decay());
    adam(r.lr(), r.beta1(), r.beta2(), r.eps(), r.amsgrad(), p, g, st);
  }
  void operator()(const Adam& r, at::Tensor& p, at::Tensor& g, std::vector<at::Tensor>& st) const {
    at::Tensor grad = r.weight_decay() != 0 ? g.add(p, r.weight_decay()) : g;
    adam(r.lr(), r.beta1(), r.beta2(), r.eps(), r.amsgrad(), p, grad, st);
  }
  void operator()(const SGD& r, at::Tensor& p, at::Tensor& g, std::vector<at::Tensor>& st) const {
    at::Tensor d_p = r.weight_decay() != 0 ? g.add(p, r.weight_decay()) : g;
    if (r.momentum() != 0) {
      at::Tensor& buf = st[0];
      if (step == 1) {
        buf.copy_(d_p);  // torch starts the buffer at the first gradient, not at zero
      } else {
        buf.mul_(r.momentum()).add_(d_p, 1 - r.dampening());
      }
      d_p = r.nesterov() ? d_p.add(buf, r.momentum()) : buf;
    }
    p.add_(d_p, -r.lr());
  }
  void operator()(const Adagrad& r, at::Tensor& p, at::Tensor& g, std::vector<at::Tensor>& st) const {
    at::Tensor grad = r.weight_decay() != 0 ? g.add(p, r.weight_decay()) : g;
    const double clr = r.lr() / (1 + static_cast<double>(step - 1) * r.lr_decay());
    st[0].addcmul_(grad, grad, 1.0);
    at::Tensor std = st[0].sqrt().add_(r.eps());
    p.addcdiv_(grad, std, -clr);
  }
  void operator()(const RMSprop& r, at::Tensor& p, at::Tensor& g, std::vector<at::Tensor>& st) const {
    at::Tensor grad = r.weight_decay() != 0 ? g.add(p, r.weight_decay()) : g;
    at::Tensor& square_avg = st[0];
    square_avg.mul_(r.alpha()).addcmul_(grad, grad, 1 - r.alpha());
    size_t next = 1;
    at::Tensor avg;
    if (r.centered()) {
      at::Tensor& grad_avg = st[1 + (r.momentum() > 0 ? 1 : 0)];
      grad_avg.mul_(r.alpha()).add_(grad, 1 - r.alpha());
      avg = square_avg.addcmul(grad_avg, grad_avg, -1).sqrt_().add_(r.eps());
    } else {
      avg = square_avg.sqrt().add_(r.eps());
    }
    if (r.momentum() > 0) {
      at::Tensor& buf = st[next];
      buf.mul_(r.momentum()).addcdiv_(grad, avg);
      p.add_(buf, -r.lr());
    } else {
      p.addcdiv_(grad, avg, -r.lr());
    }
  }
  void operator()(const Lamb&, at::Tensor&, at::Tensor&, std::vector<at::Tensor>&) const {
    SHARDOPT_INTERNAL_ASSERT(false, "LAMB has its own two-phase path");
  }

  void adam(double lr, double beta1, double beta2, double eps, bool amsgrad, at::Tensor& p,
            const at::Tensor& grad, std::vector<at::Tensor>& st) const {
    const double bias_correction1 = 1 - std::pow(beta1, static_cast<double>(step));
    const double bias_correction2 = 1 - std::pow(beta2, static_cast<double>(step));
    st[0].mul_(beta1).add_(grad, 1 - beta1);
    st[1].mul_(beta2).addcmul_(grad, grad, 1 - beta2);
    at::Tensor denom;
    if (amsgrad) {
      at::max_out(st[2], st[1], st[2]);
      denom = (st[2].sqrt() / std::sqrt(bias_correction2)).add_(eps);
    } else {
      denom = (st[1].sqrt() / std::sqrt(bias_correction2)).add_(eps);
    }
    p.addcdiv_(st[0], denom, -lr / bias_correction1);
  }
};

// Note [Stage 3 units]
// Buckets never span units (shardopt/units.hpp). Unit u is gathered by allocating storage for its
// buckets' full buffers and all-gathering each bucket's shards into them; it is released by
// freeing that storage (StorageImpl::reset), so the model's parameters keep their shape and
// autograd identity but hold no bytes. Autograd saved the parameters themselves (or views of
// them), which share the StorageImpl, so gathering again before a unit's backward makes them
// valid again. Forward: Units::run enters (gather; prefetch the next units of the last pass's
// order) and exits (release). Backward: a hook on the unit's outputs gathers it (prefetching the
// unit that backward reaches next); once every parameter of the unit has its gradient (stage 2's
// bucket path reduce-scatters them), the unit is released. The root unit (parameters in no unit
// or in two, e.g. tied embeddings) stays gathered like a stage-2 parameter and is re-gathered by
// step(). Collectives are issued in the same order on every rank because forward and backward
// visit units in the same order everywhere (as DDP assumes of its buckets).

class Engine final : public UnitRuntime, public ShardAccess {
 public:
  Engine(torch::optim::Optimizer& owner, std::vector<ParamGroup> groups, Rule rule,
         ShardOptimizerFactory factory, CommunicatorPtr comm, ZeroOptions options)
      : owner_(owner), comm_(std::move(comm)), options_(options), default_rule_(std::move(rule)),
        factory_(std::move(factory)) {
    SHARDOPT_CHECK(comm_, InvalidArgument, "optimizer: the communicator is null");
    options_.validate();
    rank_ = comm_->rank();
    world_ = comm_->size();
    if (options_.precision == Precision::FP16) scaler_.emplace(options_.loss_scale);
    collect(std::move(groups));
    verify_same_model();
    build_layout();
    if (stage3()) release_all_but_root();
    build_segments();
    attach_hooks();
    if (stage3() && unit_plan_) unit_plan_->attach(this);
  }

  ~Engine() override {
    if (unit_plan_) unit_plan_->detach(this);
    for (auto& u : units_) {
      for (auto& w : u.works) {
        try {
          w->wait(options_.timeout);
        } catch (...) {
        }
      }
    }
    // Outstanding collectives write into our buffers: let them land before the buffers go.
    for (auto& b : buckets_) {
      if (b.work) {
        try {
          b.work->wait(options_.timeout);
        } catch (...) {
        }
      }
    }
    for (auto& p : params_) {
      if (p.accumulator && p.hook_key) p.accumulator->del_post_hook(p.hook_key);
    }
  }

  at::Tensor step(const torch::optim::Optimizer::LossClosure& closure) {
    at::Tensor loss;
    if (closure) {
      at::AutoGradMode grad_mode(true);
      loss = closure();
    }
    at::NoGradGuard no_grad;
    const auto t0 = Clock::now();
    stats_ = StepStats{};
    stats_.step = steps_;

    {
      RECORD_FUNCTION("shardopt::reduce", std::vector<c10::IValue>());
      const auto t = Clock::now();
      finish_reduction();
      stats_.reduce_wait_s = seconds_since(t);
    }
    if (scaler_) {
      stats_.loss_scale = scaler_->scale();
      if (scaler_->update(any_rank_non_finite())) {
        // fp16 overflow somewhere: no update on any rank; the scaler has backed off.
        stats_.skipped = true;
        end_step(t0);
        return loss;
      }
    }
    {
      RECORD_FUNCTION("shardopt::clip", std::vector<c10::IValue>());
      clip();
    }
    {
      RECORD_FUNCTION("shardopt::update", std::vector<c10::IValue>());
      const auto t = Clock::now();
      update();
      if (separate_master_) {
        for (auto& s : segments_) {
          if (!s.low_done) s.low.copy_(s.param);  // master -> model dtype/device
        }
      }
      stats_.update_s = seconds_since(t);
    }
    {
      RECORD_FUNCTION("shardopt::gather", std::vector<c10::IValue>());
      const auto t = Clock::now();
      gather();
      stats_.gather_s = seconds_since(t);
    }
    ++steps_;
    end_step(t0);
    return loss;
  }

  // The bookkeeping every step() ends with, taken or skipped.
  void end_step(Clock::time_point t0) {
    stats_.step = steps_;
    micro_steps_ = 0;
    stats_.comm_elements = comm_elements_;
    comm_elements_ = 0;
    stats_.step_s = seconds_since(t0);
  }

  void zero_grad() {
    at::NoGradGuard no_grad;
    if (grad_flat_.defined()) {
      grad_flat_.zero_();
      for (auto& p : params_) p.tensor.mutable_grad() = p.grad_view;
    }
    if (grad_shard_.defined()) grad_shard_.zero_();
    for (auto& p : params_) {
      if (bucket_grads_) p.tensor.mutable_grad().reset();
    }
    for (auto& b : buckets_) b.launched_micro = -1;
    micro_steps_ = 0;
  }

  void backward(const at::Tensor& loss) {
    if (scaler_) {
      (loss * scaler_->scale()).backward();
    } else {
      loss.backward();
    }
    if (in_backward_) on_backward_end();  // no final callback ran (no hook fired)
  }

  const StepStats& last_step() const { return stats_; }

  MemoryReport memory() const {
    MemoryReport m;
    m.param_bytes = static_cast<int64_t>(stage3() ? param_shard_.nbytes() : param_flat_.nbytes());
    for (const auto& full : full_) m.buffer_bytes += full.storage().nbytes();  // gathered units
    if (grad_flat_.defined()) m.grad_bytes += grad_flat_.nbytes();
    if (grad_shard_.defined()) m.grad_bytes += grad_shard_.nbytes();
    for (const auto& s : state_) m.optimizer_state_bytes += s.nbytes();
    if (separate_master_) m.optimizer_state_bytes += master_.nbytes();
    for (const auto& b : pool_) m.buffer_bytes += b.nbytes();
    return m;
  }

  const ZeroOptions& options() const { return options_; }
  const CommunicatorPtr& communicator() const { return comm_; }
  int64_t numel() const { return layout_.numel; }
  int64_t padded_numel() const { return layout_.padded_numel; }

  // Stage 3: gathers every unit now (e.g. to read or save the whole model); each is released
  // again when the next forward leaves it, or by the next step().
  void gather_full_parameters() {
    if (!stage3()) return;
    for (int u = 0; u < root_unit_; ++u) {
      if (!units_[u].gathered) launch_gather(u);
    }
    for (int u = 0; u < root_unit_; ++u) ensure_gathered(u);
  }

  // ---- UnitRuntime (stage 3): called by Units::run and the output hooks ---------------------

  void enter(int unit) override {
    if (forward_order_.size() > 4 * units_.size() + 16) {  // forwards without backward (eval)
      previous_order_ = std::move(forward_order_);
      forward_order_.clear();
    }
    forward_order_.push_back(unit);
    if (unit != root_unit_) ensure_gathered(unit);
    // Prefetch what came next in the last pass (declaration order on the first pass).
    const size_t k = forward_order_.size() - 1;
    for (int i = 1; i <= options_.prefetch; ++i) {
      int next = -1;
      if (k + i < previous_order_.size()) {
        next = previous_order_[k + i];
      } else if (previous_order_.empty()) {
        next = unit + i;
      }
      if (next >= 0 && next < root_unit_ && !units_[next].gathered) launch_gather(next);
    }
  }

  void exit(int unit) override {
    if (unit != root_unit_) release(unit);
  }

  void mark_for_backward(int unit, const at::Tensor& output) override {
    output.register_hook([this, unit](const at::Tensor&) { before_backward(unit); });
  }
  // ---- checkpoint access (detail::ShardAccess, used by src/checkpoint.cpp) -------------------
  const FlatLayout& layout() const override { return layout_; }
  const ZeroOptions& zero_options() const override { return options_; }
  const CommunicatorPtr& comm() const override { return comm_; }
  const std::string& param_name(int index) const override { return params_[index].name; }
  int64_t param_order(int index) const override { return params_[index].order; }
  std::vector<int64_t> param_shape(int index) const override {
    return params_[index].tensor.sizes().vec();
  }
  at::ScalarType master_dtype() const override {
    return master_options_.dtype().toScalarType();
  }
  bool has_factory_optimizer() const override { return inner_ != nullptr; }
  int state_buffer_count() const override { return static_cast<int>(state_.size()); }
  // The master weights: fp32 copy (mixed precision, offload), stage 3's shard, or the model's
  // flat buffer.
  at::Tensor owned_param_slice(int bucket) override {
    const auto& bl = layout_.buckets[bucket];
    if (separate_master_) {
      return master_.narrow(
          0, options_.stage == 0 ? bl.flat_offset + rank_ * bl.shard : bl.shard_offset, bl.shard);
    }
    if (stage3()) return param_shard_.narrow(0, bl.shard_offset, bl.shard);
    return param_flat_.narrow(0, bl.flat_offset + rank_ * bl.shard, bl.shard);
  }
  // Stage 0 keeps full-length state (a bucket at its flat_offset); stages 1-2 only the shard.
  at::Tensor owned_state_slice(int state, int bucket) override {
    const auto& bl = layout_.buckets[bucket];
    const int64_t at0 = options_.stage == 0 ? bl.flat_offset + rank_ * bl.shard : bl.shard_offset;
    return state_[state].narrow(0, at0, bl.shard);
  }
  int64_t step_count() const override { return steps_; }
  void set_step_count(int64_t steps) override {
    steps_ = steps;
    stats_ = StepStats{};
    stats_.step = steps_;
  }
  int group_count() const override { return static_cast<int>(owner_.param_groups().size()); }
  Rule group_rule(int group) const override { return current_rule(group); }
  void set_group_rule(int group, const Rule& rule) override {
    static_cast<GroupOptions&>(owner_.param_groups()[group].options()).rule = rule;
  }
  std::optional<LossScaler::State> loss_scaler_state() const override {
    if (!scaler_) return std::nullopt;
    return scaler_->state();
  }
  void set_loss_scaler_state(const LossScaler::State& state) override {
    if (scaler_) scaler_->set_state(state);
  }
  void after_load() override {
    at::NoGradGuard no_grad;
    if (options_.stage == 0) {
      // Every rank holds everything at stage 0: assemble the full master weights and state.
      std::vector<WorkPtr> works;
      for (const auto& bl : layout_.buckets) {
        auto gather_bucket = [&](const at::Tensor& full) {
          at::Tensor range = full.narrow(0, bl.flat_offset, bl.padded);
          works.push_back(
              comm_->all_gather(range.narrow(0, rank_ * bl.shard, bl.shard), range, true));
        };
        gather_bucket(separate_master_ ? master_ : param_flat_);
        for (auto& s : state_) gather_bucket(s);
      }
      for (auto& w : works) w->wait(options_.timeout);
    }
    if (separate_master_) {
      for (auto& s : segments_) s.low.copy_(s.param);  // master -> model dtype
    }
    gather();  // stages 1-2: parameters; stage 3: frees stale units, gathers the root
    comm_elements_ = 0;
    zero_grad();
  }
  // ---- end of checkpoint access ---------------------------------------------------------------

 private:
  struct Param {
    std::string name;
    at::Tensor tensor;
    int group = 0;
    int unit = 0;       // stage 3: its unit (root_unit_ when in none)
    int64_t order = 0;  // position in named_parameters order
    at::Tensor grad_view;  // stages 0-1: its slice of the flat gradient buffer
    std::shared_ptr<torch::autograd::Node> accumulator;
    uintptr_t hook_key = 0;
    int64_t ready_pass = -1;  // backward pass in which its gradient last arrived
  };
  struct Bucket {
    int pending = 0;        // parameters whose gradient has not arrived this micro-step
    int64_t ready_pass = -1;  // backward pass the pending count refers to
    int launched_micro = -1;
    WorkPtr work;
    int buffer = -1;        // stage 2: pool index while filling or in flight
  };
  // Stage 3: one unit's buckets and whether their full buffers hold storage.
  struct UnitState {
    std::vector<int> buckets;
    int params = 0;           // trainable parameters in it
    bool gathered = false;    // storage allocated (and filled once `works` complete)
    std::vector<WorkPtr> works;  // all-gathers in flight
    int pending = 0;          // parameters whose gradient has not arrived in this pass
    int64_t ready_pass = -1;
  };
  // One contiguous run the local update covers: a bucket (stage 0) or its owned slice.
  struct Segment {
    int bucket = 0;
    int group = 0;
    int64_t bucket_begin = 0;  // first element, in bucket coordinates
    int64_t state_offset = 0;
    at::Tensor param;  // the update's target: master weights, or the model's own storage
    at::Tensor grad;
    at::Tensor low;    // separate master: the model's storage to cast the result into
    bool low_done = false;  // this step's update already wrote `low` (fused kernels)
  };

  // ---- construction ------------------------------------------------------------------------

  void collect(std::vector<ParamGroup> groups) {
    SHARDOPT_CHECK(!groups.empty(), InvalidArgument, "optimizer: no parameter groups given");
    std::unordered_map<const c10::TensorImpl*, std::string> seen;
    int64_t order = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
      Rule rule = default_rule_;
      if (groups[g].lr) set_rule_lr(rule, *groups[g].lr);
      if (groups[g].weight_decay) set_rule_weight_decay(rule, *groups[g].weight_decay);
      SHARDOPT_CHECK(!factory_ || (!groups[g].lr && !groups[g].weight_decay), InvalidArgument,
                     "optimizer: group {} overrides lr/weight_decay, which a factory-built "
                     "optimizer cannot see; give the factory's optimizer its own groups", g);
      group_rules_.push_back(rule);
      torch_groups_.emplace_back();
      for (auto& np : groups[g].params) {
        SHARDOPT_CHECK(np.tensor.defined(), InvalidArgument,
                       "optimizer: parameter '{}' is an undefined tensor", np.name);
        ++order;
        if (!np.tensor.requires_grad()) continue;  // frozen: not ours to shard
        auto [it, fresh] = seen.emplace(np.tensor.unsafeGetTensorImpl(), np.name);
        if (!fresh) {
          SHARDOPT_CHECK(param_group_of(it->second) == static_cast<int>(g), InvalidArgument,
                         "optimizer: parameter '{}' is the same tensor as '{}' but sits in another "
                         "parameter group", np.name, it->second);
          continue;  // tied: one copy in the layout
        }
        SHARDOPT_CHECK(np.tensor.is_leaf(), InvalidArgument,
                       "optimizer: parameter '{}' is not a leaf tensor", np.name);
        Param p;
        p.name = np.name;
        p.tensor = np.tensor;
        p.group = static_cast<int>(g);
        p.order = order;
        params_.push_back(std::move(p));
        torch_groups_.back().push_back(np.tensor);
      }
    }
    SHARDOPT_CHECK(!params_.empty(), InvalidArgument,
                   "optimizer: no trainable parameters (all are frozen or the list is empty)");
    const auto& first = params_.front().tensor;
    for (const auto& p : params_) {
      SHARDOPT_CHECK(p.tensor.scalar_type() == first.scalar_type() &&
                         p.tensor.device() == first.device(),
                     InvalidArgument,
                     "optimizer: all trainable parameters must share dtype and device; '{}' is {} "
                     "but '{}' is {}", p.name, describe(p.tensor), params_.front().name,
                     describe(first));
    }
    const bool compute_typed = mixed() && first.scalar_type() == compute_dtype();
    SHARDOPT_CHECK(first.scalar_type() == at::kFloat || first.scalar_type() == at::kDouble ||
                       compute_typed,
                   InvalidArgument,
                   "optimizer: parameters must be float32 or float64{}, '{}' is {}",
                   mixed() ? fmt::format(" (or {} with precision {})", c10::toString(compute_dtype()),
                                         to_string(options_.precision))
                           : std::string(),
                   params_.front().name, describe(first));
    SHARDOPT_CHECK(!mixed() || first.scalar_type() != at::kDouble, InvalidArgument,
                   "optimizer: precision {} needs float32 parameters (the master copy is fp32), "
                   "'{}' is {}", to_string(options_.precision), params_.front().name,
                   describe(first));
    if (stage3()) assign_units();
    // Layout order: by group, (unit,) then reverse registration order (see Note [Flat layout]).
    std::stable_sort(params_.begin(), params_.end(), [](const Param& a, const Param& b) {
      if (a.group != b.group) return a.group < b.group;
      if (a.unit != b.unit) return a.unit < b.unit;
      return a.order > b.order;
    });
  }

  bool stage3() const { return options_.stage == 3; }

  // Each parameter's unit: the first unit declaring it; declared by two units, or by none, it
  // belongs to the root unit.
  void assign_units() {
    unit_plan_ = options_.units;
    root_unit_ = unit_plan_ ? unit_plan_->size() : 0;
    std::unordered_map<const c10::TensorImpl*, int> unit_of;
    for (int u = 0; u < root_unit_; ++u) {
      for (const auto& t : unit_plan_->parameters(u)) {
        auto [it, fresh] = unit_of.emplace(t.unsafeGetTensorImpl(), u);
        if (!fresh && it->second != u) it->second = root_unit_;  // shared by two units
      }
    }
    units_.resize(root_unit_ + 1);
    for (auto& p : params_) {
      auto it = unit_of.find(p.tensor.unsafeGetTensorImpl());
      p.unit = it == unit_of.end() ? root_unit_ : it->second;
      ++units_[p.unit].params;
    }
    units_[root_unit_].gathered = true;
  }

  int param_group_of(const std::string& name) const {
    for (const auto& p : params_) {
      if (p.name == name) return p.group;
    }
    return -1;
  }

  // Ranks compare digests of (name, shape, dtype, group) for every parameter; on a mismatch all
  // ranks learn the first differing parameter and every rank's view of it, and all throw.
  void verify_same_model() {
    if (world_ == 1) return;
    std::vector<std::string> desc;
    for (const auto& p : params_) {
      desc.push_back(fmt::format("'{}' {} (group {}{})", p.name, describe(p.tensor), p.group,
                                 stage3() ? fmt::format(", unit {}", p.unit) : std::string()));
    }
    at::Tensor count = at::full({1}, static_cast<int64_t>(desc.size()), at::kLong);
    at::Tensor counts = at::empty({world_}, at::kLong);
    comm_->all_gather(count, counts, true)->wait(options_.timeout);
    const int64_t width = counts.max().item<int64_t>() + 1;
    at::Tensor mine = at::zeros({width}, at::kLong);
    auto* m = mine.data_ptr<int64_t>();
    m[0] = static_cast<int64_t>(desc.size());
    for (size_t i = 0; i < desc.size(); ++i) m[i + 1] = fnv1a(desc[i]);
    at::Tensor all = at::empty({world_ * width}, at::kLong);
    comm_->all_gather(mine, all, true)->wait(options_.timeout);
    auto* a = all.data_ptr<int64_t>();
    int64_t first_bad = -1;
    for (int64_t i = 1; i < width && first_bad < 0; ++i) {
      for (int r = 1; r < world_; ++r) {
        if (a[r * width + i] != a[i]) first_bad = i - 1;
      }
    }
    if (first_bad < 0) {
      for (int r = 1; r < world_; ++r) {
        if (a[r * width] != a[0]) first_bad = std::min(a[r * width], a[0]);
      }
    }
    if (first_bad < 0) return;
    // Everyone agrees on first_bad: exchange the descriptions of that parameter.
    constexpr int64_t kText = 200;
    std::string text = first_bad < static_cast<int64_t>(desc.size())
                           ? desc[first_bad] : std::string("no such parameter");
    text.resize(kText, '\0');
    at::Tensor line = at::from_blob(text.data(), {kText}, at::kByte).clone();
    at::Tensor lines = at::empty({world_ * kText}, at::kByte);
    comm_->all_gather(line, lines, true)->wait(options_.timeout);
    std::string report;
    for (int r = 0; r < world_; ++r) {
      std::string s(reinterpret_cast<const char*>(lines.data_ptr<uint8_t>()) + r * kText, kText);
      report += fmt::format("\n  rank {}: {} trainable parameters, #{} is {}", r, a[r * width],
                            first_bad, s.c_str());
    }
    SHARDOPT_FAIL(Mismatch,
                  "optimizer: the model differs across ranks at trainable parameter #{} (in "
                  "layout order); every rank must build the same model:{}",
                  first_bad, report);
  }

  void build_layout() {
    std::vector<int64_t> numels;
    std::vector<int> groups, units;
    for (const auto& p : params_) {
      numels.push_back(p.tensor.numel());
      groups.push_back(p.group);
      if (stage3()) units.push_back(p.unit);
    }
    const auto& proto = params_.front().tensor;
    const int64_t elem = static_cast<int64_t>(proto.element_size());
    layout_ = make_layout(numels, groups, world_, std::max<int64_t>(1, options_.align_bytes / elem),
                          std::max<int64_t>(1, options_.bucket_bytes / elem), units);
    // Where everything lives (Note [Mixed precision] in shardopt/precision.hpp): the model's
    // parameters in the compute dtype on their device; master weights, optimizer state and
    // reduced gradients in fp32 (mixed) on the host (offload) or next to the parameters.
    const auto base = proto.options().requires_grad(false);
    model_options_ = base.dtype(mixed() ? compute_dtype() : proto.scalar_type());
    master_options_ = base.dtype(mixed() ? at::kFloat : proto.scalar_type());
    if (options_.offload == Offload::CPU) {
      master_options_ = master_options_.device(at::kCPU).pinned_memory(!proto.is_cpu());
    }
    separate_master_ = mixed() || master_options_.device() != model_options_.device();
    bucket_grads_ = options_.stage >= 2 || mixed() || options_.offload != Offload::None;
    reduce_options_ = model_options_.dtype(mixed() && options_.reduce_in_fp32
                                               ? at::kFloat : model_options_.dtype().toScalarType());

    // Initial values, full and in master precision: rank 0's reach every rank (as DDP does),
    // then become the model's storage and the master shard.
    at::NoGradGuard no_grad;
    at::Tensor initial = at::zeros({layout_.padded_numel}, base.dtype(master_options_.dtype()));
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& slot = layout_.slots[i];
      initial.narrow(0, layout_.buckets[slot.bucket].flat_offset + slot.offset, slot.numel)
          .copy_(params_[i].tensor.reshape(-1));
    }
    if (options_.broadcast_initial_params && world_ > 1) {
      comm_->broadcast(initial, 0, true)->wait(options_.timeout);
    }
    if (stage3()) {
      param_shard_ = owned_slices(initial, model_options_);
      for (size_t b = 0; b < layout_.buckets.size(); ++b) {
        const auto& bl = layout_.buckets[b];
        full_.push_back(initial.narrow(0, bl.flat_offset, bl.padded).to(model_options_, false, true));
        units_[bl.unit].buckets.push_back(static_cast<int>(b));
      }
    } else {
      param_flat_ = initial.to(model_options_);  // no copy when nothing changes
    }
    if (separate_master_) {
      master_ = options_.stage == 0 ? initial.to(master_options_, false, true)
                                    : owned_slices(initial, master_options_);
    }
    initial.reset();
    if (!bucket_grads_) grad_flat_ = at::zeros({layout_.padded_numel}, model_options_);
    if (bucket_grads_) {
      // Reduced gradients: the owned slices (stage 0: everything), in master precision.
      grad_shard_ = at::zeros(
          {options_.stage == 0 ? layout_.padded_numel : layout_.shard_numel}, master_options_);
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i];
      const auto& slot = layout_.slots[i];
      const auto& bl = layout_.buckets[slot.bucket];
      at::Tensor view = stage3()
          ? full_[slot.bucket].narrow(0, slot.offset, slot.numel).view(p.tensor.sizes())
          : param_flat_.narrow(0, bl.flat_offset + slot.offset, slot.numel).view(p.tensor.sizes());
      p.tensor.set_data(view);  // same TensorImpl (autograd identity), our storage
      if (grad_flat_.defined()) {
        p.grad_view = grad_flat_.narrow(0, bl.flat_offset + slot.offset, slot.numel)
                          .view(p.tensor.sizes());
        p.tensor.mutable_grad() = p.grad_view;
      } else {
        p.tensor.mutable_grad().reset();
      }
    }
    buckets_.resize(layout_.buckets.size());
  }

  // This rank's slice of every bucket of a full-length flat tensor, packed as a shard buffer.
  at::Tensor owned_slices(const at::Tensor& flat, const at::TensorOptions& options) const {
    at::Tensor out = at::empty({layout_.shard_numel}, options);
    for (const auto& bl : layout_.buckets) {
      out.narrow(0, bl.shard_offset, bl.shard)
          .copy_(flat.narrow(0, bl.flat_offset + rank_ * bl.shard, bl.shard));
    }
    return out;
  }

  // Stage 3 after construction: every unit but the root gives its full storage back.
  void release_all_but_root() {
    for (int u = 0; u < root_unit_; ++u) {
      units_[u].gathered = true;
      release(u);
    }
  }

  void build_segments() {
    const bool sharded = options_.stage >= 1;
    for (size_t b = 0; b < layout_.buckets.size(); ++b) {
      const auto& bl = layout_.buckets[b];
      Segment s;
      s.bucket = static_cast<int>(b);
      s.group = bl.group;
      s.bucket_begin = sharded ? rank_ * bl.shard : 0;
      const int64_t len = sharded ? bl.shard : bl.padded;
      s.state_offset = sharded ? bl.shard_offset : bl.flat_offset;
      at::Tensor model = stage3() ? param_shard_.narrow(0, bl.shard_offset, len)
                                  : param_flat_.narrow(0, bl.flat_offset + s.bucket_begin, len);
      if (separate_master_) {
        s.param = master_.narrow(0, s.state_offset, len);
        s.low = model;
      } else {
        s.param = model;
      }
      s.grad = bucket_grads_ ? grad_shard_.narrow(0, s.state_offset, len)
                             : grad_flat_.narrow(0, bl.flat_offset + s.bucket_begin, len);
      segments_.push_back(s);
    }
    const int64_t state_numel = sharded ? layout_.shard_numel : layout_.padded_numel;
    if (factory_) {
      for (auto& s : segments_) {
        at::Tensor t = s.param;
        t.mutable_grad() = s.grad;
        inner_params_.push_back(t);
      }
      inner_ = factory_(inner_params_);
      SHARDOPT_CHECK(inner_ != nullptr, InvalidArgument, "optimizer: the factory returned null");
    } else {
      const int n = state_count(default_rule_);
      for (int k = 0; k < n; ++k) state_.push_back(at::zeros({state_numel}, master_options_));
      if (auto* ada = std::get_if<Adagrad>(&default_rule_)) {
        state_[0].fill_(ada->initial_accumulator_value());
      }
    }
  }

  // ---- gradient hooks -----------------------------------------------------------------------

  struct ReadyHook : torch::autograd::FunctionPostHook {
    ReadyHook(Engine* engine, int index) : engine(engine), index(index) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      engine->on_grad_ready(index);
      return outputs;
    }
    Engine* engine;
    int index;
  };

  void attach_hooks() {
    for (size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i];
      p.accumulator = torch::autograd::impl::grad_accumulator(p.tensor);
      SHARDOPT_INTERNAL_ASSERT(p.accumulator != nullptr, "no grad accumulator for '{}'", p.name);
      p.hook_key = p.accumulator->add_post_hook(
          std::make_unique<ReadyHook>(this, static_cast<int>(i)));
    }
  }

  // First event of a backward pass: arrange for on_backward_end when autograd finishes.
  void begin_backward_pass() {
    if (in_backward_) return;
    in_backward_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] {
      if (in_backward_) on_backward_end();
    });
  }

  void on_grad_ready(int index) {
    begin_backward_pass();
    auto& p = params_[index];
    const auto& slot = layout_.slots[index];
    auto& b = buckets_[slot.bucket];
    SHARDOPT_CHECK(b.launched_micro < 0 || bucket_grads_, InvalidArgument,
                   "optimizer: gradient of '{}' arrived after its bucket was reduced; call "
                   "backward() at most grad_accumulation_steps ({}) times per step()",
                   p.name, options_.grad_accumulation_steps);
    if (b.ready_pass != passes_) {
      b.ready_pass = passes_;
      b.pending = static_cast<int>(layout_.buckets[slot.bucket].params.size());
    }
    if (p.ready_pass == passes_) return;  // reentrant double fire: counted once
    // Stage 2: last micro-step's reduction of this bucket must land before its buffer refills.
    if (b.work && b.launched_micro != micro_steps_) complete(slot.bucket);
    p.ready_pass = passes_;
    at::Tensor& grad = p.tensor.mutable_grad();
    if (!bucket_grads_) {
      // Autograd accumulated in place unless someone replaced .grad: fold it back in.
      if (grad.defined() && !grad.is_same(p.grad_view) &&
          grad.data_ptr() != p.grad_view.data_ptr()) {
        p.grad_view.add_(grad);
      }
      grad = p.grad_view;
    } else {
      const int buf = acquire_buffer(slot.bucket);
      if (grad.defined()) {
        pool_[buf].narrow(0, slot.offset, slot.numel).view(grad.sizes()).copy_(grad);
      } else {
        pool_[buf].narrow(0, slot.offset, slot.numel).zero_();
      }
      grad.reset();  // the full gradient is freed as soon as it is in the bucket
    }
    if (--b.pending == 0 && options_.overlap_comm && reduces_this_micro_step()) {
      launch(slot.bucket);
    }
    if (stage3() && p.unit != root_unit_) {
      // Every parameter of the unit has its gradient: its backward is over, free it.
      auto& u = units_[p.unit];
      if (u.ready_pass != passes_) {
        u.ready_pass = passes_;
        u.pending = u.params;
      }
      if (--u.pending == 0) release(p.unit);
    }
  }

  bool reduces_this_micro_step() const {
    return bucket_grads_ || micro_steps_ + 1 >= options_.grad_accumulation_steps;
  }

  // End of one backward pass: reduce what is still pending (buckets with unused parameters,
  // or all of them without overlap) when this micro-step communicates.
  void on_backward_end() {
    in_backward_ = false;
    ++passes_;
    if (stage3()) {
      // Units whose parameters got no gradient (or a prefetch nobody used) are freed here.
      for (int u = 0; u < root_unit_; ++u) release(u);
      previous_order_ = std::move(forward_order_);
      forward_order_.clear();
    }
    if (reduces_this_micro_step()) {
      for (size_t b = 0; b < buckets_.size(); ++b) {
        if (buckets_[b].launched_micro != micro_steps_) launch(static_cast<int>(b));
      }
    }
    ++micro_steps_;
  }

  // Stage 2: a bucket buffer from the pool; when all are busy, the oldest in-flight bucket is
  // completed and its buffer reused, so the pool stays at the few buckets in flight at once.
  int acquire_buffer(int bucket) {
    auto& b = buckets_[bucket];
    if (b.buffer >= 0) return b.buffer;
    const int64_t numel = max_bucket_numel();
    int index = -1;
    if (!free_buffers_.empty()) {
      index = free_buffers_.back();
      free_buffers_.pop_back();
    } else if (!in_flight_.empty() && static_cast<int>(pool_.size()) >= kMaxBuffers) {
      const int oldest = in_flight_.front();
      complete(oldest);
      index = free_buffers_.back();
      free_buffers_.pop_back();
    } else {
      pool_.push_back(at::empty({numel}, reduce_options_));
      index = static_cast<int>(pool_.size()) - 1;
    }
    b.buffer = index;
    // Parameters that never report a gradient this micro-step count as zero, as does padding.
    pool_[index].narrow(0, 0, layout_.buckets[bucket].padded).zero_();
    return index;
  }

  int64_t max_bucket_numel() const {
    int64_t n = 0;
    for (const auto& bl : layout_.buckets) n = std::max(n, bl.padded);
    return n;
  }

  void launch(int bucket) {
    auto& b = buckets_[bucket];
    const auto& bl = layout_.buckets[bucket];
    b.launched_micro = micro_steps_;
    at::Tensor range;
    if (bucket_grads_) {
      range = pool_[acquire_buffer(bucket)].narrow(0, 0, bl.padded);
      in_flight_.push_back(bucket);
    } else {
      range = grad_flat_.narrow(0, bl.flat_offset, bl.padded);
    }
    if (options_.stage == 0) {
      b.work = comm_->all_reduce(range, ReduceOp::Sum, true);
      comm_elements_ += 2 * bl.padded;
    } else {
      b.work = comm_->reduce_scatter(range, range.narrow(0, rank_ * bl.shard, bl.shard),
                                     ReduceOp::Sum, true);
      comm_elements_ += bl.padded;
    }
    if (!options_.overlap_comm) complete(bucket);
  }

  // Waits for a bucket's reduction; the bucket path folds the result into the reduced gradients
  // (fp32 and on the host where the master weights are) and returns the buffer to the pool.
  void complete(int bucket) {
    auto& b = buckets_[bucket];
    if (!b.work) return;
    b.work->wait(options_.timeout);
    b.work.reset();
    if (bucket_grads_) {
      const auto& bl = layout_.buckets[bucket];
      const bool whole = options_.stage == 0;
      at::Tensor reduced = pool_[b.buffer].narrow(0, whole ? 0 : rank_ * bl.shard,
                                                  whole ? bl.padded : bl.shard);
      grad_shard_.narrow(0, whole ? bl.flat_offset : bl.shard_offset, reduced.numel())
          .add_(reduced.to(grad_shard_.device()));
      free_buffers_.push_back(b.buffer);
      b.buffer = -1;
      in_flight_.erase(std::find(in_flight_.begin(), in_flight_.end(), bucket));
    }
  }

  // ---- the phases of step() -----------------------------------------------------------------

  void finish_reduction() {
    if (in_backward_) on_backward_end();
    const bool nothing_reduced = std::all_of(buckets_.begin(), buckets_.end(),
                                             [](const Bucket& b) { return b.launched_micro < 0; });
    if (nothing_reduced) {
      // step() without backward() through our hooks (e.g. gradients set by hand): reduce now.
      for (size_t i = 0; i < params_.size(); ++i) {
        auto& p = params_[i];
        at::Tensor& g = p.tensor.mutable_grad();
        if (!bucket_grads_) {
          if (g.defined() && g.data_ptr() != p.grad_view.data_ptr()) p.grad_view.copy_(g);
          g = p.grad_view;
        } else if (g.defined()) {
          const auto& slot = layout_.slots[i];
          pool_[acquire_buffer(slot.bucket)].narrow(0, slot.offset, slot.numel).copy_(g.reshape(-1));
          g.reset();
        }
      }
      micro_steps_ = std::max(micro_steps_, 1);
      for (size_t b = 0; b < buckets_.size(); ++b) launch(static_cast<int>(b));
    }
    for (size_t b = 0; b < buckets_.size(); ++b) complete(static_cast<int>(b));
    for (auto& b : buckets_) b.launched_micro = -1;
    const double loss_scale = scaler_ ? scaler_->scale() : 1.0;
    const double scale =
        1.0 / (static_cast<double>(world_) * std::max(1, micro_steps_) * loss_scale);
    for (auto& s : segments_) s.grad.mul_(scale);
  }

  void clip() {
    if (options_.max_grad_norm <= 0) return;
    at::Tensor sq = at::zeros({1}, at::kDouble);
    double local = 0;
    for (auto& s : segments_) {
      const double n = s.grad.norm().item<double>();
      local += n * n;
    }
    sq.fill_(local);
    if (options_.stage >= 1) all_reduce_small(sq);
    const double norm = std::sqrt(sq.item<double>());
    stats_.grad_norm = norm;
    const double coef = options_.max_grad_norm / (norm + 1e-6);
    if (coef < 1) {
      stats_.clipped = true;
      for (auto& s : segments_) s.grad.mul_(coef);
    }
  }

  void all_reduce_small(at::Tensor& t, ReduceOp op = ReduceOp::Sum) {
    comm_->all_reduce(t, op, true)->wait(options_.timeout);
  }

  // fp16: whether any rank holds a non-finite reduced gradient (each checks its own shards).
  bool any_rank_non_finite() {
    bool bad = false;
    for (auto& s : segments_) bad = bad || !s.grad.isfinite().all().item<bool>();
    at::Tensor flag = at::full({1}, bad ? 1.0f : 0.0f, at::kFloat);
    if (world_ > 1) all_reduce_small(flag, ReduceOp::Max);
    return flag.item<float>() > 0;
  }

  void update() {
    if (inner_) {
      inner_->step();
      return;
    }
    const int64_t step = steps_ + 1;
    if (std::holds_alternative<Lamb>(default_rule_)) {
      lamb_update(step);
      return;
    }
    for (auto& s : segments_) {
      const Rule& rule = current_rule(s.group);
      std::vector<at::Tensor> st;
      for (auto& full : state_) st.push_back(full.narrow(0, s.state_offset, s.param.numel()));
      s.low_done = fused_step(rule, step, s, st);
      if (!s.low_done) {
        std::visit([&](const auto& r) { RuleStep{step}(r, s.param, s.grad, st); }, rule);
      }
    }
  }

  // ---- fused kernels (src/kernels): one pass over a segment, same arithmetic as RuleStep -----

  bool fusable(const Segment& s) const {
    return options_.fused_update && s.param.is_cpu() && s.param.scalar_type() == at::kFloat &&
           s.grad.is_cpu() && s.grad.scalar_type() == at::kFloat;
  }

  // The compute-dtype copy a kernel writes in the same pass, from element `begin` of a segment.
  kernels::LowPrecisionOut low_out(const Segment& s, int64_t begin = 0) const {
    kernels::LowPrecisionOut out;
    if (!separate_master_ || !s.low.is_cpu()) return out;
    const auto dtype = s.low.scalar_type();
    if (dtype != at::kBFloat16 && dtype != at::kHalf) return out;
    out.kind = dtype == at::kBFloat16 ? kernels::LowPrecision::BFloat16
                                      : kernels::LowPrecision::Float16;
    out.data = reinterpret_cast<uint16_t*>(s.low.data_ptr()) + begin;
    return out;
  }

  // Steps the segment with a fused kernel when one exists for the rule; returns whether it did
  // (and then also wrote the compute-dtype copy, when there is one on the host).
  bool fused_step(const Rule& rule, int64_t step, Segment& s, std::vector<at::Tensor>& st) {
    if (!fusable(s)) return false;
    const auto low = low_out(s);
    if (low.kind == kernels::LowPrecision::None && separate_master_) return false;
    float* param = s.param.data_ptr<float>();
    const float* grad = s.grad.data_ptr<float>();
    const int64_t n = s.param.numel();
    auto adam = [&](const auto& r, bool decoupled) {
      kernels::AdamHyper h;
      h.lr = r.lr(), h.beta1 = r.beta1(), h.beta2 = r.beta2(), h.eps = r.eps();
      h.weight_decay = r.weight_decay(), h.decoupled = decoupled, h.amsgrad = r.amsgrad();
      h.step = step;
      kernels::fused_adam(h, {param, grad, st[0].data_ptr<float>(), st[1].data_ptr<float>(),
                              r.amsgrad() ? st[2].data_ptr<float>() : nullptr, low, n});
      return true;
    };
    if (const auto* r = std::get_if<AdamW>(&rule)) return adam(*r, true);
    if (const auto* r = std::get_if<Adam>(&rule)) return adam(*r, false);
    if (const auto* r = std::get_if<SGD>(&rule)) {
      kernels::SgdHyper h;
      h.lr = r->lr(), h.momentum = r->momentum(), h.dampening = r->dampening();
      h.weight_decay = r->weight_decay(), h.nesterov = r->nesterov(), h.step = step;
      kernels::fused_sgd(h, {param, grad, r->momentum() != 0 ? st[0].data_ptr<float>() : nullptr,
                             low, n});
      return true;
    }
    return false;  // Adagrad, RMSprop: torch's ops (RuleStep)
  }

  // LAMB with the fused phases, per parameter piece (the trust ratio is per parameter).
  bool fused_lamb(int64_t step, double* acc, at::Tensor& sums) {
    for (const auto& s : segments_) {
      if (!fusable(s) || (separate_master_ && low_out(s).kind == kernels::LowPrecision::None)) {
        return false;
      }
    }
    auto hyper = [&](const Segment& s) {
      const auto& r = std::get<Lamb>(current_rule(s.group));
      kernels::LambHyper h;
      h.lr = r.lr(), h.beta1 = r.beta1(), h.beta2 = r.beta2(), h.eps = r.eps();
      h.weight_decay = r.weight_decay(), h.step = step;
      return h;
    };
    auto piece = [&](Segment& s, int64_t begin, int64_t len, bool with_low) {
      const int64_t at0 = s.state_offset + begin;
      return kernels::LambSegment{s.param.data_ptr<float>() + begin,
                                  s.grad.data_ptr<float>() + begin,
                                  state_[0].data_ptr<float>() + at0,
                                  state_[1].data_ptr<float>() + at0,
                                  with_low ? low_out(s, begin) : kernels::LowPrecisionOut{}, len};
    };
    for (auto& s : segments_) {
      const auto h = hyper(s);
      for_each_param_piece(s, [&](int index, int64_t begin, int64_t len) {
        const auto norms = kernels::fused_lamb_phase1(h, piece(s, begin, len, false));
        acc[2 * index] += norms.param_sq;
        acc[2 * index + 1] += norms.update_sq;
      });
    }
    if (options_.stage >= 1) all_reduce_small(sums);
    for (auto& s : segments_) {
      const auto h = hyper(s);
      for_each_param_piece(s, [&](int index, int64_t begin, int64_t len) {
        const double w = std::sqrt(acc[2 * index]), u = std::sqrt(acc[2 * index + 1]);
        kernels::fused_lamb_phase2(h, (w > 0 && u > 0) ? w / u : 1.0, piece(s, begin, len, true));
      });
      // Padding between parameters keeps a zero compute-dtype copy; nothing else to write.
      s.low_done = true;
    }
    return true;
  }

  // The rule of group g as the torch param group holds it now (LR schedulers write there).
  const Rule& current_rule(int g) const {
    auto& options = owner_.param_groups()[g].options();
    return static_cast<const GroupOptions&>(options).rule;
  }

  // LAMB in two phases: (1) moments and the raw update per segment, partial squared norms of
  // weights and updates per parameter; one all-reduce of the partial sums; (2) each parameter
  // scaled by its trust ratio ||w|| / ||u||.
  void lamb_update(int64_t step) {
    const int64_t np = static_cast<int64_t>(params_.size());
    at::Tensor sums = at::zeros({2 * np}, at::kDouble);
    auto* acc = sums.data_ptr<double>();
    if (fused_lamb(step, acc, sums)) return;
    for (auto& s : segments_) s.low_done = false;
    std::vector<at::Tensor> updates;
    for (auto& s : segments_) {
      const auto& r = std::get<Lamb>(current_rule(s.group));
      at::Tensor m = state_[0].narrow(0, s.state_offset, s.param.numel());
      at::Tensor v = state_[1].narrow(0, s.state_offset, s.param.numel());
      m.mul_(r.beta1()).add_(s.grad, 1 - r.beta1());
      v.mul_(r.beta2()).addcmul_(s.grad, s.grad, 1 - r.beta2());
      const double bc1 = 1 - std::pow(r.beta1(), static_cast<double>(step));
      const double bc2 = 1 - std::pow(r.beta2(), static_cast<double>(step));
      at::Tensor u = (m / bc1) / ((v / bc2).sqrt() + r.eps());
      if (r.weight_decay() != 0) u.add_(s.param, r.weight_decay());
      for_each_param_piece(s, [&](int index, int64_t begin, int64_t len) {
        const double w = s.param.narrow(0, begin, len).norm().item<double>();
        const double n = u.narrow(0, begin, len).norm().item<double>();
        acc[2 * index] += w * w;
        acc[2 * index + 1] += n * n;
      });
      updates.push_back(u);
    }
    if (options_.stage >= 1) all_reduce_small(sums);
    for (size_t k = 0; k < segments_.size(); ++k) {
      auto& s = segments_[k];
      const auto& r = std::get<Lamb>(current_rule(s.group));
      for_each_param_piece(s, [&](int index, int64_t begin, int64_t len) {
        const double w = std::sqrt(acc[2 * index]), u = std::sqrt(acc[2 * index + 1]);
        const double trust = (w > 0 && u > 0) ? w / u : 1.0;
        s.param.narrow(0, begin, len).add_(updates[k].narrow(0, begin, len), -r.lr() * trust);
      });
    }
  }

  // Calls fn(param index, begin, length) for each parameter's intersection with a segment,
  // begin relative to the segment.
  template <typename Fn>
  void for_each_param_piece(const Segment& s, Fn&& fn) const {
    const auto& bl = layout_.buckets[s.bucket];
    const ShardRange seg{s.bucket_begin, s.bucket_begin + s.param.numel()};
    for (int index : bl.params) {
      const auto& slot = layout_.slots[index];
      const ShardRange piece = intersect(seg, {slot.offset, slot.offset + slot.numel});
      if (!piece.empty()) fn(index, piece.begin - seg.begin, piece.size());
    }
  }

  void gather() {
    if (options_.stage == 0) return;
    if (stage3()) {
      // Non-root units gather on demand; one gathered by hand holds stale values now.
      for (int u = 0; u < root_unit_; ++u) release(u);
      launch_gather(root_unit_);
      ensure_gathered(root_unit_);
      return;
    }
    std::vector<WorkPtr> works;
    for (const auto& bl : layout_.buckets) {
      at::Tensor range = param_flat_.narrow(0, bl.flat_offset, bl.padded);
      works.push_back(comm_->all_gather(range.narrow(0, rank_ * bl.shard, bl.shard), range, true));
      comm_elements_ += bl.padded;
    }
    for (auto& w : works) w->wait(options_.timeout);
  }

  // ---- stage 3: gathering and releasing units (see Note [Stage 3 units]) --------------------

  // Allocates the unit's full buffers and starts all-gathering its shards into them.
  void launch_gather(int unit) {
    auto& u = units_[unit];
    for (int b : u.buckets) {
      const auto& bl = layout_.buckets[b];
      at::Tensor& full = full_[b];
      auto* storage = full.storage().unsafeGetStorageImpl();
      if (storage->nbytes() == 0) {
        const size_t nbytes = static_cast<size_t>(full.numel()) * full.element_size();
        storage->set_data_ptr_noswap(c10::GetAllocator(full.device().type())->allocate(nbytes));
        storage->set_nbytes(nbytes);
      }
      u.works.push_back(
          comm_->all_gather(param_shard_.narrow(0, bl.shard_offset, bl.shard), full, true));
      comm_elements_ += bl.padded;
    }
    u.gathered = true;
  }

  void ensure_gathered(int unit) {
    auto& u = units_[unit];
    if (!u.gathered) launch_gather(unit);
    for (auto& w : u.works) w->wait(options_.timeout);
    u.works.clear();
  }

  // Frees the unit's full storage (the parameters keep their shape, not their bytes).
  void release(int unit) {
    auto& u = units_[unit];
    if (!u.gathered) return;
    for (auto& w : u.works) w->wait(options_.timeout);  // never free under a collective
    u.works.clear();
    for (int b : u.buckets) full_[b].storage().unsafeGetStorageImpl()->reset();
    u.gathered = false;
  }

  // Backward reached the unit's outputs: its parameters are needed again; prefetch the unit
  // backward reaches next (the one before it in this pass's forward order).
  void before_backward(int unit) {
    begin_backward_pass();
    if (unit == root_unit_) return;
    ensure_gathered(unit);
    auto it = std::find(forward_order_.rbegin(), forward_order_.rend(), unit);
    for (int i = 0; i < options_.prefetch && it != forward_order_.rend(); ++i) {
      if (++it == forward_order_.rend()) break;
      if (*it != root_unit_ && !units_[*it].gathered) launch_gather(*it);
    }
  }

 public:
  std::vector<std::vector<at::Tensor>> torch_groups_;
  std::vector<Rule> group_rules_;

 private:
  static constexpr int kMaxBuffers = 2;
  torch::optim::Optimizer& owner_;
  CommunicatorPtr comm_;
  ZeroOptions options_;
  Rule default_rule_;
  ShardOptimizerFactory factory_;
  int rank_ = 0;
  int world_ = 1;
  std::vector<Param> params_;
  FlatLayout layout_;
  std::vector<Bucket> buckets_;
  std::vector<Segment> segments_;
  bool mixed() const { return options_.precision != Precision::FP32; }
  at::ScalarType compute_dtype() const {
    return options_.precision == Precision::BF16 ? at::kBFloat16
           : options_.precision == Precision::FP16 ? at::kHalf : at::kFloat;
  }

  at::TensorOptions model_options_;   // the model's parameters: compute dtype, their device
  at::TensorOptions master_options_;  // master weights, state, reduced gradients
  at::TensorOptions reduce_options_;  // bucket buffers: the dtype gradients are reduced in
  bool separate_master_ = false;  // mixed precision or offload: the update targets master_
  bool bucket_grads_ = false;     // gradients leave autograd per bucket (stages 2-3, mixed, offload)
  std::optional<LossScaler> scaler_;  // fp16
  at::Tensor master_;      // separate master weights: stage 0 full, else this rank's shard
  at::Tensor param_flat_;  // stages 0-2: every parameter, the model's storage
  at::Tensor param_shard_;  // stage 3: this rank's slice of every bucket
  std::vector<at::Tensor> full_;  // stage 3: per bucket, storage only while its unit is gathered
  std::vector<UnitState> units_;  // stage 3: declared units, then the root unit
  int root_unit_ = 0;
  UnitsPtr unit_plan_;
  std::vector<int> forward_order_;   // units entered in this pass
  std::vector<int> previous_order_;  // ... and in the last pass (prefetch order)
  at::Tensor grad_flat_;   // stages 0-1 in fp32 without offload: the params' .grad are views
  at::Tensor grad_shard_;  // bucket path: reduced gradients (stage 0: full length)
  std::vector<at::Tensor> pool_;  // stage 2 bucket buffers
  std::vector<int> free_buffers_;
  std::deque<int> in_flight_;
  std::vector<at::Tensor> state_;
  std::unique_ptr<torch::optim::Optimizer> inner_;
  std::vector<at::Tensor> inner_params_;
  int64_t steps_ = 0;
  int micro_steps_ = 0;     // backward passes since the last step()
  int64_t passes_ = 0;      // backward passes ever: stamps "arrived in this pass"
  bool in_backward_ = false;
  int64_t comm_elements_ = 0;
  StepStats stats_;
};

}  // namespace detail

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
  for (size_t g = 0; g < engine_->torch_groups_.size(); ++g) {
    torch::optim::OptimizerParamGroup group(engine_->torch_groups_[g],
                                            defaults_of(engine_->group_rules_[g]));
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
  for (size_t g = 0; g < engine_->torch_groups_.size(); ++g) {
    torch::optim::OptimizerParamGroup group(engine_->torch_groups_[g],
                                            defaults_of(engine_->group_rules_[g]));
    add_param_group(group);
  }
}

DistributedOptimizer::~DistributedOptimizer() = default;

namespace detail {
ShardAccess& shard_access(DistributedOptimizer& optimizer) { return *optimizer.engine_; }
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

Rule DistributedOptimizer::group_rule(size_t group) const {
  SHARDOPT_CHECK(group < param_groups().size(), InvalidArgument,
                 "optimizer: parameter group {} does not exist, there are {}", group,
                 param_groups().size());
  return static_cast<const detail::GroupOptions&>(param_groups()[group].options()).rule;
}

void DistributedOptimizer::set_group_rule(size_t group, const Rule& rule) {
  SHARDOPT_CHECK(group < param_groups().size(), InvalidArgument,
                 "optimizer: parameter group {} does not exist, there are {}", group,
                 param_groups().size());
  Rule& current = static_cast<detail::GroupOptions&>(param_groups()[group].options()).rule;
  SHARDOPT_CHECK(rule.index() == current.index(), InvalidArgument,
                 "optimizer: parameter group {} steps with {}, it cannot switch to {}", group,
                 rule_name(current), rule_name(rule));
  // The state buffers were allocated for the construction-time rule: keep their number and order.
  const auto* rms_new = std::get_if<RMSprop>(&rule);
  const auto* rms_old = std::get_if<RMSprop>(&current);
  SHARDOPT_CHECK(detail::state_count(rule) == detail::state_count(current) &&
                     (!rms_new || rms_new->centered() == rms_old->centered()),
                 InvalidArgument,
                 "optimizer: parameter group {}: this change to the {} hyper-parameters needs "
                 "other optimizer state than was allocated (momentum zero vs non-zero, amsgrad, "
                 "centered); set it when constructing the optimizer",
                 group, rule_name(rule));
  current = rule;
}

}  // namespace shardopt
