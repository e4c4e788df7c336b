/// \file
/// Hyper-parameters of the optimizers DistributedOptimizer runs natively over its shard. Light
/// structs (no torch/optim headers); fluent like torch's options: AdamW(1e-4).weight_decay(0.01).
/// Defaults equal torch's.
///
/// Note [One place per rule]
/// Each rule says here, and only here, what the rest of the library needs to know about it:
///   kName          its name ("adamw"): checkpoints, Python, error messages;
///   fields(r, v)   every hyper-parameter in torch's order, as v(Field{name, lowest value}, member)
///                  with member a double or a bool: the checkpoint JSON codec and the Python
///                  dict codec are written once over it (detail/rule_traits.hpp);
///   state_names()  the state buffers it keeps, with torch::optim's names, in the engine's order:
///                  their number is what the engine allocates, the names key checkpoints.
/// A new rule is its struct here, an entry in `Rule`, and its update code in the engine.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <variant>
#include <vector>

/// One hyper-parameter of a rule: a fluent setter `name(value)`, a getter `name()` and the
/// member `name_` with torch's default (undefined at the end of this header).
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
namespace detail {

/// One hyper-parameter as the codecs see it: torch's name, and the lowest value torch accepts
/// (doubles; checked where values come from users, i.e. Python).
struct Field {
  constexpr Field(const char* name, double lowest = 0.0) : name(name), lowest(lowest) {}
  const char* name;
  double lowest;
};

inline std::vector<std::string> adam_state_names(bool amsgrad) {
  std::vector<std::string> names{"exp_avg", "exp_avg_sq"};
  if (amsgrad) names.push_back("max_exp_avg_sq");
  return names;
}

}  // namespace detail

/// torch::optim::Adam's rule: hyper-parameters `lr` (1e-3), `beta1` (0.9), `beta2` (0.999),
/// `eps` (1e-8), `weight_decay` (0: L2 added to the gradient) and `amsgrad` (false), each set
/// fluently (`Adam(1e-4).beta2(0.98)`) and read by its name (`rule.lr()`).
struct Adam {
  explicit Adam(double lr = 1e-3) : lr_(lr) {}  ///< With this learning rate.
  static constexpr const char* kName = "adam";  ///< The rule's name: checkpoints, Python, errors.
  SHARDOPT_ARG(double, lr, 1e-3);
  SHARDOPT_ARG(double, beta1, 0.9);
  SHARDOPT_ARG(double, beta2, 0.999);
  SHARDOPT_ARG(double, eps, 1e-8);
  SHARDOPT_ARG(double, weight_decay, 0.0);  ///< L2 added to the gradient
  SHARDOPT_ARG(bool, amsgrad, false);

 public:
  /// Visits every hyper-parameter in torch's order (Note [One place per rule]).
  template <class Self, class Visit>
  static void fields(Self& r, Visit&& v) {
    v("lr", r.lr_); v("beta1", r.beta1_); v("beta2", r.beta2_); v("eps", r.eps_);
    v("weight_decay", r.weight_decay_); v("amsgrad", r.amsgrad_);
  }
  /// The state buffers the rule keeps, by torch::optim's names, in the engine's order.
  std::vector<std::string> state_names() const { return detail::adam_state_names(amsgrad_); }
};

/// torch::optim::AdamW's rule: hyper-parameters `lr` (1e-3), `beta1` (0.9), `beta2` (0.999),
/// `eps` (1e-8), `weight_decay` (0.01, decoupled) and `amsgrad` (false), each set fluently
/// (`AdamW(1e-4).weight_decay(0.01)`) and read by its name.
struct AdamW {
  explicit AdamW(double lr = 1e-3) : lr_(lr) {}  ///< With this learning rate.
  static constexpr const char* kName = "adamw";  ///< The rule's name: checkpoints, Python, errors.
  SHARDOPT_ARG(double, lr, 1e-3);
  SHARDOPT_ARG(double, beta1, 0.9);
  SHARDOPT_ARG(double, beta2, 0.999);
  SHARDOPT_ARG(double, eps, 1e-8);
  SHARDOPT_ARG(double, weight_decay, 1e-2);  ///< decoupled
  SHARDOPT_ARG(bool, amsgrad, false);

 public:
  /// Visits every hyper-parameter in torch's order (Note [One place per rule]).
  template <class Self, class Visit>
  static void fields(Self& r, Visit&& v) {
    Adam::fields(r, v);  // the same names; only the decay differs
  }
  /// The state buffers the rule keeps, by torch::optim's names, in the engine's order.
  std::vector<std::string> state_names() const { return detail::adam_state_names(amsgrad_); }

 private:
  friend struct Adam;
};

/// torch::optim::SGD's rule: `lr` (required), `momentum` (0), `dampening` (0), `weight_decay`
/// (0) and `nesterov` (false), each set fluently and read by its name.
struct SGD {
  explicit SGD(double lr) : lr_(lr) {}  ///< SGD has no default rate, as torch.
  static constexpr const char* kName = "sgd";  ///< The rule's name: checkpoints, Python, errors.
  SHARDOPT_ARG(double, lr, 0.0);
  SHARDOPT_ARG(double, momentum, 0.0);
  SHARDOPT_ARG(double, dampening, 0.0);
  SHARDOPT_ARG(double, weight_decay, 0.0);
  SHARDOPT_ARG(bool, nesterov, false);

 public:
  /// Visits every hyper-parameter in torch's order (Note [One place per rule]).
  template <class Self, class Visit>
  static void fields(Self& r, Visit&& v) {
    v("lr", r.lr_); v("momentum", r.momentum_); v({"dampening", kAnyValue}, r.dampening_);
    v("weight_decay", r.weight_decay_); v("nesterov", r.nesterov_);
  }
  /// The state buffers the rule keeps, by torch::optim's names, in the engine's order.
  std::vector<std::string> state_names() const {
    if (momentum_ == 0.0) return {};
    return {"momentum_buffer"};
  }
  /// torch.optim.SGD's constraint, checked where rules come from users (Python): empty when met.
  std::string problem() const;

 private:
  static constexpr double kAnyValue = -std::numeric_limits<double>::infinity();
};

/// torch::optim::Adagrad's rule: `lr` (0.01), `lr_decay` (0), `weight_decay` (0),
/// `initial_accumulator_value` (0) and `eps` (1e-10), each set fluently and read by its name.
struct Adagrad {
  explicit Adagrad(double lr = 1e-2) : lr_(lr) {}  ///< With this learning rate.
  /// The rule's name: checkpoints, Python, errors.
  static constexpr const char* kName = "adagrad";
  SHARDOPT_ARG(double, lr, 1e-2);
  SHARDOPT_ARG(double, lr_decay, 0.0);
  SHARDOPT_ARG(double, weight_decay, 0.0);
  SHARDOPT_ARG(double, initial_accumulator_value, 0.0);
  SHARDOPT_ARG(double, eps, 1e-10);

 public:
  /// Visits every hyper-parameter in torch's order (Note [One place per rule]).
  template <class Self, class Visit>
  static void fields(Self& r, Visit&& v) {
    v("lr", r.lr_); v("lr_decay", r.lr_decay_); v("weight_decay", r.weight_decay_);
    v("initial_accumulator_value", r.initial_accumulator_value_); v("eps", r.eps_);
  }
  /// The state buffers the rule keeps, by torch::optim's names, in the engine's order.
  std::vector<std::string> state_names() const { return {"sum"}; }
};

/// torch::optim::RMSprop's rule: `lr` (0.01), `alpha` (0.99), `eps` (1e-8), `weight_decay`
/// (0), `momentum` (0) and `centered` (false), each set fluently and read by its name.
struct RMSprop {
  explicit RMSprop(double lr = 1e-2) : lr_(lr) {}  ///< With this learning rate.
  /// The rule's name: checkpoints, Python, errors.
  static constexpr const char* kName = "rmsprop";
  SHARDOPT_ARG(double, lr, 1e-2);
  SHARDOPT_ARG(double, alpha, 0.99);
  SHARDOPT_ARG(double, eps, 1e-8);
  SHARDOPT_ARG(double, weight_decay, 0.0);
  SHARDOPT_ARG(double, momentum, 0.0);
  SHARDOPT_ARG(bool, centered, false);

 public:
  /// Visits every hyper-parameter in torch's order (Note [One place per rule]).
  template <class Self, class Visit>
  static void fields(Self& r, Visit&& v) {
    v("lr", r.lr_); v("alpha", r.alpha_); v("eps", r.eps_); v("weight_decay", r.weight_decay_);
    v("momentum", r.momentum_); v("centered", r.centered_);
  }
  /// The state buffers the rule keeps, by torch::optim's names, in the engine's order.
  std::vector<std::string> state_names() const {
    std::vector<std::string> names{"square_avg"};
    if (momentum_ > 0.0) names.push_back("momentum_buffer");
    if (centered_) names.push_back("grad_avg");
    return names;
  }
};

/// LAMB (You et al. 2019): Adam's update scaled per tensor by ||w|| / ||update||. The norms span
/// whole tensors, which shards split: partial sums are all-reduced, so sharded LAMB equals LAMB.
/// Hyper-parameters `lr` (1e-3), `beta1` (0.9), `beta2` (0.999), `eps` (1e-6), `weight_decay` (0).
struct Lamb {
  explicit Lamb(double lr = 1e-3) : lr_(lr) {}  ///< With this learning rate.
  static constexpr const char* kName = "lamb";  ///< The rule's name: checkpoints, Python, errors.
  SHARDOPT_ARG(double, lr, 1e-3);
  SHARDOPT_ARG(double, beta1, 0.9);
  SHARDOPT_ARG(double, beta2, 0.999);
  SHARDOPT_ARG(double, eps, 1e-6);
  SHARDOPT_ARG(double, weight_decay, 0.0);

 public:
  /// Visits every hyper-parameter in torch's order (Note [One place per rule]).
  template <class Self, class Visit>
  static void fields(Self& r, Visit&& v) {
    v("lr", r.lr_); v("beta1", r.beta1_); v("beta2", r.beta2_); v("eps", r.eps_);
    v("weight_decay", r.weight_decay_);
  }
  /// The state buffers the rule keeps, by torch::optim's names, in the engine's order.
  std::vector<std::string> state_names() const { return detail::adam_state_names(false); }
};

/// torch.optim.Adafactor's rule (torch >= 2.5): second moments factored into row and column
/// means for every tensor of two or more dimensions (over its last two), a full second moment for
/// vectors and scalars; no first moment. Hyper-parameters `lr` (1e-2: the cap of the relative step
/// size and the decoupled weight decay's rate), `beta2_decay` (-0.8), `eps1` (torch's eps[0]:
/// negative means torch's None, the machine epsilon of the parameter's dtype), `eps2` (eps[1],
/// 1e-3), `d` (1.0, the update's clipping threshold), `weight_decay` (0) and `maximize` (false).
/// The row and column statistics, the parameter's RMS and the update's RMS span whole tensors,
/// which shards split: they are all-reduced, so sharded Adafactor equals torch's (Note
/// [Factored state in flat shards], src/engine/adafactor_update.hpp).
struct Adafactor {
  explicit Adafactor(double lr = 1e-2) : lr_(lr) {}  ///< With this learning rate.
  /// The rule's name: checkpoints, Python, errors.
  static constexpr const char* kName = "adafactor";
  SHARDOPT_ARG(double, lr, 1e-2);
  SHARDOPT_ARG(double, beta2_decay, -0.8);
  SHARDOPT_ARG(double, eps1, -1.0);  ///< < 0: torch's None (the dtype's machine epsilon)
  SHARDOPT_ARG(double, eps2, 1e-3);
  SHARDOPT_ARG(double, d, 1.0);
  SHARDOPT_ARG(double, weight_decay, 0.0);  ///< decoupled, at rate lr
  SHARDOPT_ARG(bool, maximize, false);

 public:
  /// Visits every hyper-parameter in torch's order (Note [One place per rule]); torch spells
  /// eps1, eps2 as one pair, `eps`.
  template <class Self, class Visit>
  static void fields(Self& r, Visit&& v) {
    v("lr", r.lr_); v({"beta2_decay", kAnyValue}, r.beta2_decay_); v({"eps1", kAnyValue}, r.eps1_);
    v("eps2", r.eps2_); v({"d", 1.0}, r.d_); v("weight_decay", r.weight_decay_);
    v("maximize", r.maximize_);
  }
  /// The state buffer the rule keeps in the flat layout: one element per parameter element,
  /// holding torch's `variance` for vectors and `row_var`, `col_var` packed for matrices.
  std::vector<std::string> state_names() const { return {"factored_variance"}; }
  /// torch.optim.Adafactor's constraint on beta2_decay, checked where rules come from users
  /// (Python): empty when met.
  std::string problem() const;

 private:
  static constexpr double kAnyValue = -std::numeric_limits<double>::infinity();
};

/// 8-bit AdamW (bitsandbytes' blockwise 8-bit Adam, Dettmers et al. 2022): AdamW's update, its
/// two moments stored as one byte per element, quantised in blocks of 256 elements of a parameter
/// with bitsandbytes' dynamic maps (signed for the first moment, unsigned for the second) scaled
/// by the block's absolute maximum (fp32). Parameters of fewer than `min_8bit_size` (4096)
/// elements keep fp32 moments, as bitsandbytes does. Blocks are parameter-relative and the flat
/// layout starts every parameter at a multiple of 256, so a block never straddles a shard and the
/// result does not depend on the number of ranks (Note [Blockwise 8-bit state],
/// src/engine/adam8bit_update.hpp). Hyper-parameters `lr` (1e-3), `beta1` (0.9), `beta2`
/// (0.999), `eps` (1e-8), `weight_decay` (0.01, decoupled) and `min_8bit_size` (4096).
struct AdamW8bit {
  explicit AdamW8bit(double lr = 1e-3) : lr_(lr) {}  ///< With this learning rate.
  /// The rule's name: checkpoints, Python, errors.
  static constexpr const char* kName = "adamw8bit";
  static constexpr int64_t kBlock = 256;  ///< elements per quantisation block
  SHARDOPT_ARG(double, lr, 1e-3);
  SHARDOPT_ARG(double, beta1, 0.9);
  SHARDOPT_ARG(double, beta2, 0.999);
  SHARDOPT_ARG(double, eps, 1e-8);
  SHARDOPT_ARG(double, weight_decay, 1e-2);  ///< decoupled
  SHARDOPT_ARG(double, min_8bit_size, 4096.0);  ///< smaller parameters keep fp32 moments

 public:
  /// Visits every hyper-parameter (Note [One place per rule]), bitsandbytes' names.
  template <class Self, class Visit>
  static void fields(Self& r, Visit&& v) {
    v("lr", r.lr_); v("beta1", r.beta1_); v("beta2", r.beta2_); v("eps", r.eps_);
    v("weight_decay", r.weight_decay_); v("min_8bit_size", r.min_8bit_size_);
  }
  /// The state buffers, bitsandbytes' names: the codes of m and v (one byte per element), the
  /// per-block absolute maxima of m and v, and the fp32 m and v of the small parameters.
  std::vector<std::string> state_names() const {
    return {"state1", "state2", "absmax1", "absmax2", "state1_fp32", "state2_fp32"};
  }
};

/// torch.optim.Muon's rule (torch >= 2.9) for the 2-D parameters, AdamW for the others, in one
/// optimizer (torch's docs pair Muon with AdamW for embeddings, heads, biases and norms). A 2-D
/// parameter of a group whose rule has `use_muon` (true) runs Muon: its momentum buffer lerps
/// towards the gradient, the (Nesterov) update is orthogonalised by `ns_steps` Newton-Schulz
/// iterations with coefficients (`ns_a`, `ns_b`, `ns_c`) in `ns_dtype` (16: bfloat16 as torch; 32
/// or 64: float32, float64), then decoupled weight decay and the update at lr scaled by
/// `adjust_lr_fn` (kOriginal: sqrt(max(1, A/B)), torch's None and "original"; kMatchRmsAdamW:
/// 0.2 sqrt(max(A, B)); kSpectralUnclamped: sqrt(A/B)). Every other parameter (vectors, scalars,
/// tensors of 3+ dimensions, and every parameter of a group with use_muon(false)) runs
/// torch.optim.AdamW at the group's lr and weight_decay with `adamw_beta1` (0.9), `adamw_beta2`
/// (0.999) and `adamw_eps` (1e-8). Torch's defaults: lr 1e-3, weight_decay 0.1, momentum 0.95,
/// nesterov, (3.4445, -4.775, 2.0315), eps 1e-7, 5 steps. Newton-Schulz needs the whole matrix:
/// each one has one owner rank that orthogonalises it once (Note [Muon over flat shards],
/// src/engine/muon_update.hpp).
struct Muon {
  explicit Muon(double lr = 1e-3) : lr_(lr) {}  ///< With this learning rate.
  /// The rule's name: checkpoints, Python, errors.
  static constexpr const char* kName = "muon";
  static constexpr double kOriginal = 0;  ///< adjust_lr_fn: torch's None or "original"
  static constexpr double kMatchRmsAdamW = 1;  ///< adjust_lr_fn: "match_rms_adamw" (Moonshot's)
  static constexpr double kSpectralUnclamped = 2;  ///< adjust_lr_fn: "spectral_unclamped"
  SHARDOPT_ARG(double, lr, 1e-3);
  SHARDOPT_ARG(double, weight_decay, 0.1);  ///< decoupled
  SHARDOPT_ARG(double, momentum, 0.95);
  SHARDOPT_ARG(bool, nesterov, true);
  SHARDOPT_ARG(double, ns_a, 3.4445);
  SHARDOPT_ARG(double, ns_b, -4.775);
  SHARDOPT_ARG(double, ns_c, 2.0315);
  SHARDOPT_ARG(double, eps, 1e-7);
  SHARDOPT_ARG(double, ns_steps, 5.0);      ///< an integer in [0, 100)
  SHARDOPT_ARG(double, adjust_lr_fn, 0.0);  ///< kOriginal, kMatchRmsAdamW or kSpectralUnclamped
  SHARDOPT_ARG(double, ns_dtype, 16.0);     ///< Newton-Schulz in bfloat16 (16), float32, float64
  SHARDOPT_ARG(bool, use_muon, true);       ///< false: the group's parameters all run AdamW
  SHARDOPT_ARG(double, adamw_beta1, 0.9);
  SHARDOPT_ARG(double, adamw_beta2, 0.999);
  SHARDOPT_ARG(double, adamw_eps, 1e-8);

 public:
  /// Visits every hyper-parameter, torch.optim.Muon's in its order (its ns_coefficients as
  /// ns_a, ns_b, ns_c), then shardopt's (Note [One place per rule]).
  template <class Self, class Visit>
  static void fields(Self& r, Visit&& v) {
    v("lr", r.lr_); v("weight_decay", r.weight_decay_); v("momentum", r.momentum_);
    v("nesterov", r.nesterov_); v({"ns_a", kAnyValue}, r.ns_a_); v({"ns_b", kAnyValue}, r.ns_b_);
    v({"ns_c", kAnyValue}, r.ns_c_); v("eps", r.eps_); v("ns_steps", r.ns_steps_);
    v("adjust_lr_fn", r.adjust_lr_fn_); v({"ns_dtype", 16.0}, r.ns_dtype_);
    v("use_muon", r.use_muon_); v("adamw_beta1", r.adamw_beta1_);
    v("adamw_beta2", r.adamw_beta2_); v("adamw_eps", r.adamw_eps_);
  }
  /// The state buffers, element by element in the flat layout: torch.optim.Muon's
  /// momentum_buffer for Muon's matrices and torch.optim.AdamW's exp_avg for the others share
  /// the first; the second is AdamW's exp_avg_sq (unused by the matrices).
  std::vector<std::string> state_names() const { return {"momentum_buffer", "exp_avg_sq"}; }
  /// torch.optim.Muon's constraints and shardopt's on the codes, checked where rules come from
  /// users (Python) and when an optimizer is built: empty when met.
  std::string problem() const;

 private:
  static constexpr double kAnyValue = -std::numeric_limits<double>::infinity();
};

/// The order is the one error messages list the rules in.
using Rule = std::variant<AdamW, Adam, SGD, Adagrad, RMSprop, Lamb, Adafactor, AdamW8bit, Muon>;

/// "adamw", "sgd", ... of whichever rule `rule` holds.
const char* rule_name(const Rule& rule);
/// The learning rate of whichever rule `rule` holds.
double rule_lr(const Rule& rule);
/// Sets the learning rate of whichever rule `rule` holds (what LR schedulers change).
void set_rule_lr(Rule& rule, double lr);
/// Sets the weight decay of whichever rule `rule` holds.
void set_rule_weight_decay(Rule& rule, double weight_decay);

}  // namespace shardopt

#undef SHARDOPT_ARG
