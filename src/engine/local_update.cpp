// LocalUpdate: unscale, non-finite check, clipping and the update of this rank's segments.
#include "engine/local_update.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "engine/finite_check.hpp"
#include "engine/rule_step.hpp"
#include "shardopt/detail/rule_traits.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail {

LocalUpdate::LocalUpdate(FlatState& flat, CommunicatorPtr comm, Duration timeout,
                         const Rule& rule, const ShardOptimizerFactory& factory, RuleOf rule_of,
                         bool fused, const std::vector<std::vector<int64_t>>& shapes)
    : flat_(flat), comm_(comm), timeout_(timeout), finalize_(flat, timeout),
      grid_(flat, std::move(comm), timeout),
      rule_of_(std::move(rule_of)),
      lamb_(std::holds_alternative<Lamb>(rule)), low_done_(flat_.segments().size(), 0),
      bucket_segments_(flat_.layout().buckets.size()), early_(flat_.segments().size()),
      unscaled_(flat_.segments().size(), 0) {
  for (size_t k = 0; k < flat_.segments().size(); ++k) {
    bucket_segments_[flat_.segments()[k].bucket].push_back(static_cast<int>(k));
  }
  if (fused) kernels_ = fused_kernels_for(flat_.master_options().device().type());
  if (factory) {
    std::vector<at::Tensor> shard;
    for (auto& s : flat_.segments()) {
      shard.push_back(s.param);
      shard.back().mutable_grad() = s.grad;
    }
    inner_ = factory(std::move(shard));
    SHARDOPT_CHECK(inner_ != nullptr, InvalidArgument, "optimizer: the factory returned null");
    return;
  }
  const auto* ada = std::get_if<Adagrad>(&rule);
  if (std::holds_alternative<AdamW8bit>(rule)) {
    adam8bit_ = std::make_unique<Adam8bitUpdate>(flat_, std::get<AdamW8bit>(rule), rule_of_);
    return;
  }
  flat_.init_state(state_count(rule), ada ? ada->initial_accumulator_value() : 0.0);
  if (std::holds_alternative<Adafactor>(rule)) {
    adafactor_ = std::make_unique<AdafactorUpdate>(flat_, comm_, timeout_, rule_of_, shapes);
  }
  if (std::holds_alternative<Muon>(rule)) {
    muon_ = std::make_unique<MuonUpdate>(flat_, comm_, timeout_, rule_of_, shapes);
  }
}

bool LocalUpdate::can_read_param_grads(const Rule& rule, bool factory, bool fused,
                                       const at::TensorOptions& master) {
  const bool kernel_rule = std::holds_alternative<AdamW>(rule) ||
                           std::holds_alternative<Adam>(rule) || std::holds_alternative<SGD>(rule);
  return kernel_rule && !factory && fused && master.device().is_cpu() &&
         master.dtype() == at::kFloat && fused_kernels_for(c10::DeviceType::CPU) != nullptr;
}

void LocalUpdate::read_param_grads(GradOf grad_of) {
  SHARDOPT_INTERNAL_ASSERT(kernels_ && !inner_ && !lamb_ && !adafactor_ && !adam8bit_ && !muon_,
                           "parameter gradients read by a rule that needs flat ones");
  grad_of_ = std::move(grad_of);
  param_early_.assign(flat_.layout().slots.size(), std::nullopt);
  param_version_.assign(flat_.layout().slots.size(), -1);
}

namespace {
int64_t version_of(const at::Tensor& t) {
  return static_cast<int64_t>(t.unsafeGetTensorImpl()->version_counter().current_version());
}
}  // namespace

// The early check per parameter rather than per bucket: a bucket is complete only when its last
// parameter's gradient arrives, by which time the first ones have left the cache (one rank has no
// reduction to wait for). fp32 without a loss scaler: nothing to unscale.
void LocalUpdate::check_param_early(int param, bool norm) {
  const auto t = std::chrono::steady_clock::now();
  const at::Tensor& g = grad_of_(param);
  param_early_[param] = scan_local(g, 1.0, norm);
  param_version_[param] = version_of(g);
  early_norm_ = norm;
  early_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Parameters in layout order, whichever were checked early: the sum of squares is the same bits
// either way. A gradient written after its early check (Note [Gradients written after the check]
// in gradient_reducer.cpp) is checked again.
FiniteScan LocalUpdate::scan_params(bool norm) {
  FiniteScan total;
  for (size_t i = 0; i < param_early_.size(); ++i) {
    const at::Tensor& g = grad_of_(static_cast<int>(i));
    const bool reuse = param_early_[i] && early_norm_ == norm && version_of(g) == param_version_[i];
    add_scan(total, reuse ? *param_early_[i] : scan_local(g, 1.0, norm));
  }
  return total;
}

template <typename Fn>
void LocalUpdate::for_each_grad(const Segment& s, Fn&& fn) const {
  if (!grad_of_) {
    fn(int64_t{0}, s.param.numel(), s.grad);
    return;
  }
  detail::for_each_param_piece(flat_.layout(), s, [&](int param, int64_t begin, int64_t length,
                                                      int64_t param_offset) {
    fn(begin, length, grad_of_(param).view(-1).narrow(0, param_offset, length));
  });
}

at::Tensor LocalUpdate::flat_grad(const Segment& s) const {
  if (!grad_of_) return s.grad;
  at::Tensor flat = at::zeros_like(s.param);  // padding between parameters: zero gradients
  for_each_grad(s, [&](int64_t begin, int64_t length, const at::Tensor& g) {
    flat.narrow(0, begin, length).copy_(g);
  });
  return flat;
}

FiniteScan LocalUpdate::scan_segment(Segment& s, double divisor, bool norm,
                                     double* unscale_s) const {
  double scale = 1.0 / divisor;
  if (scale != 1.0 && !folds_scale(s.grad)) {  // 16-bit gradients: torch's mul_ defines their rounding
    const auto t = std::chrono::steady_clock::now();
    s.grad.mul_(scale);
    scale = 1.0;
    *unscale_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  }
  return scan_local(s.grad, scale, norm);
}

// Note [The non-finite check during backward]
// A bucket whose reduction lands while backward still runs (always at one rank) is unscaled and
// checked then, from the reducer's hook path, while its values are in cache and off step()'s
// critical path; step() checks the rest and combines the per-segment results in segment order, so
// the sum of squares (and clipping) is bitwise the same whichever segments went early. In place,
// every bucket of the reducing pass lands before backward returns (Note [Gradients are final when
// backward returns] in gradient_reducer.cpp), so between backward and step() .grad holds the
// reduced gradients divided by the world size (in place is fp32 only: no loss scale), as DDP's
// hold the average (at more than one rank they are the reducer's buffers, never the local
// gradients).
void LocalUpdate::check_early(int bucket, double divisor, bool norm) {
  if (grad_of_) return;  // checked per parameter (check_param_early)
  const auto t = std::chrono::steady_clock::now();
  double unscale_s = 0.0;
  for (int k : bucket_segments_[bucket]) {
    auto& s = flat_.segments()[k];
    if (early_[k] || !s.grad.defined() || !s.grad.device().is_cpu()) continue;
    early_[k] = scan_segment(s, divisor, norm, &unscale_s);
  }
  early_divisor_ = divisor;
  early_norm_ = norm;
  early_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

void LocalUpdate::forget_early() {
  std::fill(early_.begin(), early_.end(), std::nullopt);
  std::fill(param_early_.begin(), param_early_.end(), std::nullopt);
  std::fill(unscaled_.begin(), unscaled_.end(), 0);
  early_s_ = 0.0;
}

void LocalUpdate::recheck(int bucket) {
  for (int k : bucket_segments_[bucket]) {
    if (!early_[k]) continue;
    early_[k].reset();
    unscaled_[k] = 1;
  }
}

bool LocalUpdate::unscale_and_check(double divisor, bool norm, StepStats& stats) {
  using Clock = std::chrono::steady_clock;
  const bool any_early = std::any_of(early_.begin(), early_.end(),
                                     [](const auto& e) { return e.has_value(); });
  SHARDOPT_CHECK(!any_early || (early_divisor_ == divisor && early_norm_ == norm), Internal,
                 "optimizer: gradients were unscaled by {} during backward but step() divides "
                 "by {}", early_divisor_, divisor);
  const auto t0 = Clock::now();
  FiniteScan total;
  auto& segments = flat_.segments();
  if (grad_of_) {
    SHARDOPT_INTERNAL_ASSERT(divisor == 1.0, "parameter gradients unscaled by {}", divisor);
    total = scan_params(norm);
  }
  for (size_t k = 0; k < segments.size() && !grad_of_; ++k) {
    add_scan(total, early_[k] ? *early_[k]
                              : scan_segment(segments[k], unscaled_[k] ? 1.0 : divisor, norm,
                                             &stats.unscale_s));
  }
  const FiniteScan change = finalize_.run(norm);
  total.non_finite = total.non_finite || change.non_finite;
  total.sum_sq = std::max(0.0, total.sum_sq + change.sum_sq);  // the two sums round differently
  const auto scan = grid_.combine(total, norm);
  if (norm) stats.grad_norm = std::sqrt(scan.sum_sq);
  stats.check_s = std::chrono::duration<double>(Clock::now() - t0).count() - stats.unscale_s;
  stats.check_backward_s = early_s_;
  forget_early();
  return scan.non_finite;
}

bool LocalUpdate::clip(double max_norm, double norm) {
  const double coef = max_norm / (norm + 1e-6);
  if (!(coef < 1)) return false;
  if (grad_of_) {
    for (size_t i = 0; i < param_early_.size(); ++i) grad_of_(static_cast<int>(i)).mul_(coef);
    return true;
  }
  for (auto& s : flat_.segments()) s.grad.mul_(coef);
  return true;
}

void LocalUpdate::update(int64_t step, StepStats* stats) {
  if (inner_) {
    inner_->step();
    return;
  }
  if (lamb_) {
    lamb_update(step);
    return;
  }
  if (adafactor_) {
    adafactor_->update(step);
    return;
  }
  if (adam8bit_) {
    adam8bit_->update(step);
    return;
  }
  if (muon_) {
    muon_->update(step, stats);
    return;
  }
  auto& state = flat_.state();
  for (size_t k = 0; k < flat_.segments().size(); ++k) {
    auto& s = flat_.segments()[k];
    const Rule& rule = rule_of_(s.group);
    std::vector<at::Tensor> st;
    for (auto& full : state) st.push_back(full.narrow(0, s.state_offset, s.param.numel()));
    const bool fused = fused_step(rule, step, s, st);
    if (!fused) {
      at::Tensor grad = flat_grad(s);
      std::visit([&](const auto& r) { RuleStep{step}(r, s.param, grad, st); }, rule);
    }
    low_done_[k] = fused && low_out(s, 0).kind != kernels::LowPrecision::None;
  }
}

void LocalUpdate::write_back() {
  if (!flat_.plan().separate_master()) return;
  auto& segments = flat_.segments();
  for (size_t k = 0; k < segments.size(); ++k) {
    // master -> model dtype/device; from pinned host memory (offload) the copy is asynchronous,
    // in the device's stream order, like everything else that reads the parameters.
    auto& s = segments[k];
    if (!low_done_[k]) s.low.copy_(s.param, /*non_blocking=*/s.param.is_cpu() && !s.low.is_cpu());
    low_done_[k] = 0;
  }
}

// Steps the segment with a fused kernel when one exists for the rule; returns whether it did
// (the copy low_out names, if any, is then written too).
bool LocalUpdate::fused_step(const Rule& rule, int64_t step, Segment& s,
                             std::vector<at::Tensor>& st) {
  if (!kernels_ || (!grad_of_ && !kernels_->accepts(s))) return false;
  // The segment's elements [begin, begin + n), their gradients at `grad`.
  const auto at = [&](const at::Tensor& t, int64_t begin) { return t.data_ptr<float>() + begin; };
  auto adam = [&](const auto& r, bool decoupled) {
    kernels::AdamHyper h;
    h.lr = r.lr(), h.beta1 = r.beta1(), h.beta2 = r.beta2(), h.eps = r.eps();
    h.weight_decay = r.weight_decay(), h.decoupled = decoupled, h.amsgrad = r.amsgrad();
    h.step = step;
    for_each_grad(s, [&](int64_t begin, int64_t n, const at::Tensor& g) {
      kernels_->adam(h, {at(s.param, begin), g.data_ptr<float>(), at(st[0], begin),
                         at(st[1], begin), r.amsgrad() ? at(st[2], begin) : nullptr,
                         low_out(s, begin), n});
    });
    return true;
  };
  if (const auto* r = std::get_if<AdamW>(&rule)) return adam(*r, true);
  if (const auto* r = std::get_if<Adam>(&rule)) return adam(*r, false);
  if (const auto* r = std::get_if<SGD>(&rule)) {
    kernels::SgdHyper h;
    h.lr = r->lr(), h.momentum = r->momentum(), h.dampening = r->dampening();
    h.weight_decay = r->weight_decay(), h.nesterov = r->nesterov(), h.step = step;
    for_each_grad(s, [&](int64_t begin, int64_t n, const at::Tensor& g) {
      kernels_->sgd(h, {at(s.param, begin), g.data_ptr<float>(),
                        r->momentum() != 0 ? at(st[0], begin) : nullptr, low_out(s, begin), n});
    });
    return true;
  }
  return false;  // Adagrad, RMSprop: torch's ops (RuleStep)
}

template <typename Fn>
void LocalUpdate::for_each_param_piece(const Segment& s, Fn&& fn) const {
  detail::for_each_param_piece(flat_.layout(), s, [&](int param, int64_t begin, int64_t length,
                                                      int64_t) { fn(param, begin, length); });
}

// LAMB with the fused phases, per parameter piece (the trust ratio is per parameter).
bool LocalUpdate::fused_lamb(int64_t step, double* acc, at::Tensor& sums) {
  auto& segments = flat_.segments();
  for (const auto& s : segments) {
    if (!kernels_ || !kernels_->accepts(s)) return false;
  }
  auto& state = flat_.state();
  auto hyper = [&](const Segment& s) {
    const auto& r = std::get<Lamb>(rule_of_(s.group));
    kernels::LambHyper h;
    h.lr = r.lr(), h.beta1 = r.beta1(), h.beta2 = r.beta2(), h.eps = r.eps();
    h.weight_decay = r.weight_decay(), h.step = step;
    return h;
  };
  auto piece = [&](Segment& s, int64_t begin, int64_t len, bool with_low) {
    const int64_t at0 = s.state_offset + begin;
    return kernels::LambSegment{s.param.data_ptr<float>() + begin,
                                s.grad.data_ptr<float>() + begin,
                                state[0].data_ptr<float>() + at0,
                                state[1].data_ptr<float>() + at0,
                                with_low ? low_out(s, begin) : kernels::LowPrecisionOut{},
                                len};
  };
  for (auto& s : segments) {
    const auto h = hyper(s);
    for_each_param_piece(s, [&](int index, int64_t begin, int64_t len) {
      const auto norms = kernels_->lamb_phase1(h, piece(s, begin, len, false));
      acc[2 * index] += norms.param_sq;
      acc[2 * index + 1] += norms.update_sq;
    });
  }
  if (flat_.plan().sharded()) comm_->all_reduce(sums, ReduceOp::Sum, true)->wait(timeout_);
  for (size_t k = 0; k < segments.size(); ++k) {
    auto& s = segments[k];
    const auto h = hyper(s);
    for_each_param_piece(s, [&](int index, int64_t begin, int64_t len) {
      const double w = std::sqrt(acc[2 * index]), u = std::sqrt(acc[2 * index + 1]);
      kernels_->lamb_phase2(h, (w > 0 && u > 0) ? w / u : 1.0, piece(s, begin, len, true));
    });
    // Padding between parameters keeps a zero compute-dtype copy; nothing else to write.
    low_done_[k] = low_out(s, 0).kind != kernels::LowPrecision::None;
  }
  return true;
}

// LAMB in two phases: (1) moments, raw update and partial squared norms of weights and updates per
// parameter, all-reduced; (2) each parameter scaled by its trust ratio ||w|| / ||u||.
void LocalUpdate::lamb_update(int64_t step) {
  const int64_t np = static_cast<int64_t>(flat_.layout().slots.size());
  at::Tensor sums = at::zeros({2 * np}, at::kDouble);
  auto* acc = sums.data_ptr<double>();
  if (fused_lamb(step, acc, sums)) return;
  auto& segments = flat_.segments();
  auto& state = flat_.state();
  std::vector<at::Tensor> updates;
  for (auto& s : segments) {
    const auto& r = std::get<Lamb>(rule_of_(s.group));
    at::Tensor m = state[0].narrow(0, s.state_offset, s.param.numel());
    at::Tensor v = state[1].narrow(0, s.state_offset, s.param.numel());
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
  if (flat_.plan().sharded()) comm_->all_reduce(sums, ReduceOp::Sum, true)->wait(timeout_);
  for (size_t k = 0; k < segments.size(); ++k) {
    auto& s = segments[k];
    const auto& r = std::get<Lamb>(rule_of_(s.group));
    for_each_param_piece(s, [&](int index, int64_t begin, int64_t len) {
      const double w = std::sqrt(acc[2 * index]), u = std::sqrt(acc[2 * index + 1]);
      const double trust = (w > 0 && u > 0) ? w / u : 1.0;
      s.param.narrow(0, begin, len).add_(updates[k].narrow(0, begin, len), -r.lr() * trust);
    });
  }
}

}  // namespace shardopt::detail
