// DistributedOptimizer: flat buffers, gradient reduction from autograd hooks, the sharded update
// and the parameter gather, for ZeRO stages 0-2.
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
#include <unordered_map>

#include "shardopt/detail/partition.hpp"
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

class Engine {
 public:
  Engine(torch::optim::Optimizer& owner, std::vector<ParamGroup> groups, Rule rule,
         ShardOptimizerFactory factory, CommunicatorPtr comm, ZeroOptions options)
      : owner_(owner), comm_(std::move(comm)), options_(options), default_rule_(std::move(rule)),
        factory_(std::move(factory)) {
    SHARDOPT_CHECK(comm_, InvalidArgument, "optimizer: the communicator is null");
    options_.validate();
    rank_ = comm_->rank();
    world_ = comm_->size();
    SHARDOPT_CHECK(options_.stage <= 2, Unsupported,
                   "optimizer: stage {} is not available in this build yet; use stage 0, 1 or 2",
                   options_.stage);
    SHARDOPT_CHECK(options_.precision == Precision::FP32, Unsupported,
                   "optimizer: precision {} is not available in this build yet; use fp32",
                   to_string(options_.precision));
    collect(std::move(groups));
    verify_same_model();
    build_layout();
    if (options_.broadcast_initial_params && world_ > 1) {
      comm_->broadcast(param_flat_, 0, true)->wait(options_.timeout);
    }
    build_segments();
    attach_hooks();
  }

  ~Engine() {
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
    {
      RECORD_FUNCTION("shardopt::clip", std::vector<c10::IValue>());
      clip();
    }
    {
      RECORD_FUNCTION("shardopt::update", std::vector<c10::IValue>());
      const auto t = Clock::now();
      update();
      stats_.update_s = seconds_since(t);
    }
    {
      RECORD_FUNCTION("shardopt::gather", std::vector<c10::IValue>());
      const auto t = Clock::now();
      gather();
      stats_.gather_s = seconds_since(t);
    }
    ++steps_;
    stats_.step = steps_;
    micro_steps_ = 0;
    stats_.comm_elements = comm_elements_;
    comm_elements_ = 0;
    stats_.step_s = seconds_since(t0);
    return loss;
  }

  void zero_grad() {
    at::NoGradGuard no_grad;
    if (grad_flat_.defined()) {
      grad_flat_.zero_();
      for (auto& p : params_) p.tensor.mutable_grad() = p.grad_view;
    }
    if (grad_shard_.defined()) grad_shard_.zero_();
    for (auto& p : params_) {
      if (options_.stage == 2) p.tensor.mutable_grad().reset();
    }
    for (auto& b : buckets_) b.launched_micro = -1;
    micro_steps_ = 0;
  }

  void backward(const at::Tensor& loss) {
    loss.backward();
    if (in_backward_) on_backward_end();  // no final callback ran (no hook fired)
  }

  const StepStats& last_step() const { return stats_; }

  MemoryReport memory() const {
    MemoryReport m;
    m.param_bytes = param_flat_.defined() ? static_cast<int64_t>(param_flat_.nbytes()) : 0;
    if (grad_flat_.defined()) m.grad_bytes += grad_flat_.nbytes();
    if (grad_shard_.defined()) m.grad_bytes += grad_shard_.nbytes();
    for (const auto& s : state_) m.optimizer_state_bytes += s.nbytes();
    for (const auto& b : pool_) m.buffer_bytes += b.nbytes();
    return m;
  }

  const ZeroOptions& options() const { return options_; }
  const CommunicatorPtr& communicator() const { return comm_; }
  int64_t numel() const { return layout_.numel; }
  int64_t padded_numel() const { return layout_.padded_numel; }

 private:
  struct Param {
    std::string name;
    at::Tensor tensor;
    int group = 0;
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
  // One contiguous run the local update covers: a bucket (stage 0) or its owned slice.
  struct Segment {
    int bucket = 0;
    int group = 0;
    int64_t bucket_begin = 0;  // first element, in bucket coordinates
    int64_t state_offset = 0;
    at::Tensor param;
    at::Tensor grad;
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
    SHARDOPT_CHECK(first.scalar_type() == at::kFloat || first.scalar_type() == at::kDouble,
                   InvalidArgument, "optimizer: parameters must be float32 or float64, '{}' is {}",
                   params_.front().name, describe(first));
    // Layout order: by group, then reverse registration order (see Note [Flat layout]).
    std::stable_sort(params_.begin(), params_.end(), [](const Param& a, const Param& b) {
      return a.group != b.group ? a.group < b.group : a.order > b.order;
    });
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
      desc.push_back(fmt::format("'{}' {} (group {})", p.name, describe(p.tensor), p.group));
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
    std::vector<int> groups;
    for (const auto& p : params_) {
      numels.push_back(p.tensor.numel());
      groups.push_back(p.group);
    }
    const auto& proto = params_.front().tensor;
    const int64_t elem = static_cast<int64_t>(proto.element_size());
    layout_ = make_layout(numels, groups, world_, std::max<int64_t>(1, options_.align_bytes / elem),
                          std::max<int64_t>(1, options_.bucket_bytes / elem));
    const auto opts = proto.options().requires_grad(false);
    param_flat_ = at::zeros({layout_.padded_numel}, opts);
    if (options_.stage <= 1) grad_flat_ = at::zeros({layout_.padded_numel}, opts);
    if (options_.stage == 2) grad_shard_ = at::zeros({layout_.shard_numel}, opts);
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i];
      const auto& slot = layout_.slots[i];
      const int64_t at0 = layout_.buckets[slot.bucket].flat_offset + slot.offset;
      at::Tensor view = param_flat_.narrow(0, at0, slot.numel).view(p.tensor.sizes());
      view.copy_(p.tensor);
      p.tensor.set_data(view);  // same TensorImpl (autograd identity), our storage
      if (grad_flat_.defined()) {
        p.grad_view = grad_flat_.narrow(0, at0, slot.numel).view(p.tensor.sizes());
        p.tensor.mutable_grad() = p.grad_view;
      } else {
        p.tensor.mutable_grad().reset();
      }
    }
    buckets_.resize(layout_.buckets.size());
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
      s.param = param_flat_.narrow(0, bl.flat_offset + s.bucket_begin, len);
      s.grad = options_.stage == 2 ? grad_shard_.narrow(0, bl.shard_offset, len)
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
      for (int k = 0; k < n; ++k) state_.push_back(at::zeros({state_numel}, param_flat_.options()));
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

  void on_grad_ready(int index) {
    if (!in_backward_) {
      in_backward_ = true;
      torch::autograd::Engine::get_default_engine().queue_callback([this] {
        if (in_backward_) on_backward_end();
      });
    }
    auto& p = params_[index];
    const auto& slot = layout_.slots[index];
    auto& b = buckets_[slot.bucket];
    SHARDOPT_CHECK(b.launched_micro < 0 || options_.stage == 2, InvalidArgument,
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
    if (options_.stage <= 1) {
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
  }

  bool reduces_this_micro_step() const {
    return options_.stage == 2 || micro_steps_ + 1 >= options_.grad_accumulation_steps;
  }

  // End of one backward pass: reduce what is still pending (buckets with unused parameters,
  // or all of them without overlap) when this micro-step communicates.
  void on_backward_end() {
    in_backward_ = false;
    ++passes_;
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
      pool_.push_back(at::empty({numel}, param_flat_.options()));
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
    if (options_.stage == 0) {
      at::Tensor range = grad_flat_.narrow(0, bl.flat_offset, bl.padded);
      b.work = comm_->all_reduce(range, ReduceOp::Sum, true);
      comm_elements_ += 2 * bl.padded;
    } else if (options_.stage == 1) {
      at::Tensor range = grad_flat_.narrow(0, bl.flat_offset, bl.padded);
      b.work = comm_->reduce_scatter(range, range.narrow(0, rank_ * bl.shard, bl.shard),
                                     ReduceOp::Sum, true);
      comm_elements_ += bl.padded;
    } else {
      const int buf = acquire_buffer(bucket);
      at::Tensor range = pool_[buf].narrow(0, 0, bl.padded);
      b.work = comm_->reduce_scatter(range, range.narrow(0, rank_ * bl.shard, bl.shard),
                                     ReduceOp::Sum, true);
      comm_elements_ += bl.padded;
      in_flight_.push_back(bucket);
    }
    if (!options_.overlap_comm) complete(bucket);
  }

  // Waits for a bucket's reduction; stage 2 folds the result into the gradient shard and
  // returns the buffer to the pool.
  void complete(int bucket) {
    auto& b = buckets_[bucket];
    if (!b.work) return;
    b.work->wait(options_.timeout);
    b.work.reset();
    if (options_.stage == 2) {
      const auto& bl = layout_.buckets[bucket];
      grad_shard_.narrow(0, bl.shard_offset, bl.shard)
          .add_(pool_[b.buffer].narrow(0, rank_ * bl.shard, bl.shard));
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
      if (options_.stage <= 1) {
        for (auto& p : params_) {
          at::Tensor& g = p.tensor.mutable_grad();
          if (g.defined() && g.data_ptr() != p.grad_view.data_ptr()) p.grad_view.copy_(g);
          g = p.grad_view;
        }
      }
      micro_steps_ = std::max(micro_steps_, 1);
      for (size_t b = 0; b < buckets_.size(); ++b) launch(static_cast<int>(b));
    }
    for (size_t b = 0; b < buckets_.size(); ++b) complete(static_cast<int>(b));
    for (auto& b : buckets_) b.launched_micro = -1;
    const double scale = 1.0 / (static_cast<double>(world_) * std::max(1, micro_steps_));
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

  void all_reduce_small(at::Tensor& t) {
    comm_->all_reduce(t, ReduceOp::Sum, true)->wait(options_.timeout);
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
      std::visit([&](const auto& r) { RuleStep{step}(r, s.param, s.grad, st); }, rule);
    }
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
    std::vector<WorkPtr> works;
    for (const auto& bl : layout_.buckets) {
      at::Tensor range = param_flat_.narrow(0, bl.flat_offset, bl.padded);
      works.push_back(comm_->all_gather(range.narrow(0, rank_ * bl.shard, bl.shard), range, true));
      comm_elements_ += bl.padded;
    }
    for (auto& w : works) w->wait(options_.timeout);
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
  at::Tensor param_flat_;
  at::Tensor grad_flat_;   // stages 0-1
  at::Tensor grad_shard_;  // stage 2
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

at::Tensor DistributedOptimizer::step(LossClosure closure) { return engine_->step(closure); }
void DistributedOptimizer::zero_grad() { engine_->zero_grad(); }
void DistributedOptimizer::backward(const at::Tensor& loss) { engine_->backward(loss); }
const StepStats& DistributedOptimizer::last_step() const { return engine_->last_step(); }
MemoryReport DistributedOptimizer::memory() const { return engine_->memory(); }
const ZeroOptions& DistributedOptimizer::options() const { return engine_->options(); }
const CommunicatorPtr& DistributedOptimizer::communicator() const { return engine_->communicator(); }
int64_t DistributedOptimizer::numel() const { return engine_->numel(); }
int64_t DistributedOptimizer::padded_numel() const { return engine_->padded_numel(); }

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
