// What every rule shares, written once over the rules' own declarations (shardopt/rules.hpp):
// names, learning rate access, state buffers; plus the rules' out-of-line checks.
#include "shardopt/rules.hpp"

#include <fmt/format.h>

#include "shardopt/detail/rule_traits.hpp"

namespace shardopt {

const char* rule_name(const Rule& rule) {
  return std::visit([](const auto& r) { return std::decay_t<decltype(r)>::kName; }, rule);
}
double rule_lr(const Rule& rule) {
  return std::visit([](const auto& r) { return r.lr(); }, rule);
}
void set_rule_lr(Rule& rule, double lr) {
  std::visit([lr](auto& r) { r.lr(lr); }, rule);
}
void set_rule_weight_decay(Rule& rule, double weight_decay) {
  std::visit([weight_decay](auto& r) { r.weight_decay(weight_decay); }, rule);
}

std::string SGD::problem() const {
  // torch.optim.SGD's rule, same words.
  if (!nesterov_ || (momentum_ > 0 && dampening_ == 0)) return {};
  return fmt::format(
      "Nesterov momentum requires a momentum and zero dampening, got momentum {}, dampening {}",
      momentum_, dampening_);
}

std::string Adafactor::problem() const {
  // torch.optim.Adafactor's checks, same words.
  if (!(beta2_decay_ <= 0.0)) return fmt::format("beta2_decay should be <= 0 but is: {}", beta2_decay_);
  return {};
}

std::string Muon::problem() const {
  // torch.optim.Muon's checks (its words where it has them), then shardopt's codes.
  if (!(momentum_ >= 0.0)) return fmt::format("momentum should be >= 0 but is: {}", momentum_);
  if (!(weight_decay_ >= 0.0)) {
    return fmt::format("weight decay should be >= 0 but is: {}", weight_decay_);
  }
  if (!(ns_steps_ >= 0 && ns_steps_ < 100 && ns_steps_ == static_cast<int>(ns_steps_))) {
    return fmt::format("ns_steps must be an integer in [0, 100) (fewer than 100 Newton-Schulz "
                       "steps, as torch), got {}", ns_steps_);
  }
  if (adjust_lr_fn_ != kOriginal && adjust_lr_fn_ != kMatchRmsAdamW &&
      adjust_lr_fn_ != kSpectralUnclamped) {
    return fmt::format("Adjust learning rate function {} is not supported (0: original, 1: "
                       "match_rms_adamw, 2: spectral_unclamped)", adjust_lr_fn_);
  }
  if (ns_dtype_ != 16 && ns_dtype_ != 32 && ns_dtype_ != 64) {
    return fmt::format("ns_dtype must be 16 (bfloat16), 32 (float32) or 64 (float64), got {}",
                       ns_dtype_);
  }
  if (!(adamw_beta1_ < 1.0 && adamw_beta2_ < 1.0)) {
    return fmt::format("adamw_beta1 and adamw_beta2 must lie in [0, 1), got {} and {}",
                       adamw_beta1_, adamw_beta2_);
  }
  return {};
}

namespace detail {

std::vector<std::string> state_names(const Rule& rule) {
  return std::visit([](const auto& r) { return r.state_names(); }, rule);
}

int state_count(const Rule& rule) { return static_cast<int>(state_names(rule).size()); }

namespace {
template <std::size_t... I>
std::vector<std::string> names_of(std::index_sequence<I...>) {
  return {std::variant_alternative_t<I, Rule>::kName...};
}
}  // namespace

std::vector<std::string> rule_names() {
  return names_of(std::make_index_sequence<std::variant_size_v<Rule>>{});
}

}  // namespace detail
}  // namespace shardopt
