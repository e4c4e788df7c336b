// What the library derives from each rule's own declaration (Note [One place per rule] in
// shardopt/rules.hpp): its state buffers, the list of rule names, and a rule type picked by name.
// Torch-free; the engine, the checkpoint codec and the Python codec use it. Internal.
#pragma once

#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "shardopt/rules.hpp"

namespace shardopt::detail {

// The names torch::optim gives the state buffers `rule` keeps, in the engine's order.
std::vector<std::string> state_names(const Rule& rule);
// Number of state buffers (each one shard long) `rule` keeps: state_names(rule).size().
int state_count(const Rule& rule);
// Every rule's kName, in the order of `Rule`.
std::vector<std::string> rule_names();

template <class R>
struct RuleType {
  using type = R;
};

template <class F, std::size_t... I>
bool with_rule_named(const std::string& name, F& f, std::index_sequence<I...>) {
  return ((name == std::variant_alternative_t<I, Rule>::kName
               ? (f(RuleType<std::variant_alternative_t<I, Rule>>{}), true)
               : false) ||
          ...);
}

// Calls f(RuleType<R>{}) for the rule R named `name`; false when no rule has that name.
template <class F>
bool with_rule_named(const std::string& name, F&& f) {
  return with_rule_named(name, f, std::make_index_sequence<std::variant_size_v<Rule>>{});
}

// Rules whose constructor has no default learning rate (SGD, as in torch) must be given one.
template <class R>
constexpr bool kNeedsLr = !std::is_default_constructible_v<R>;

// A rule of type R whose fields the caller is about to set.
template <class R>
R blank_rule() {
  if constexpr (kNeedsLr<R>) {
    return R(0.0);
  } else {
    return R();
  }
}

// Every hyper-parameter of `rule` under torch's option names, in torch's order: v(name, value)
// with a double or bool value, except the pairs torch spells as one: beta1 and beta2 as
// v("betas", std::pair<double, double>), Adafactor's eps1 and eps2 as v("eps", pair) (a negative
// eps1 is torch's None), and Muon's ns_a, ns_b, ns_c as v("ns_coefficients",
// std::tuple<double, double, double>). The Python codec and torch::save archives use it.
template <class Visit>
void visit_torch_options(const Rule& rule, Visit&& v) {
  std::visit(
      [&](const auto& r) {
        double first = 0, second = 0;
        std::decay_t<decltype(r)>::fields(r, [&](const Field& f, const auto& value) {
          const std::string name = f.name;
          if (name == "beta1" || name == "eps1" || name == "ns_a") {
            first = value;
          } else if (name == "ns_b") {
            second = value;
          } else if (name == "ns_c") {
            v("ns_coefficients", std::make_tuple(first, second, static_cast<double>(value)));
          } else if (name == "beta2") {
            v("betas", std::make_pair(first, static_cast<double>(value)));
          } else if (name == "eps2") {
            v("eps", std::make_pair(first, static_cast<double>(value)));
          } else {
            v(f.name, value);
          }
        });
      },
      rule);
}

template <class R, class = void>
struct HasProblem : std::false_type {};
template <class R>
struct HasProblem<R, std::void_t<decltype(std::declval<const R&>().problem())>> : std::true_type {};

// What is wrong with `r` by its own rule's constraints (R::problem(), where R has one); empty when
// nothing is.
template <class R>
std::string rule_problem(const R& r) {
  if constexpr (HasProblem<R>::value) {
    return r.problem();
  } else {
    return {};
  }
}

}  // namespace shardopt::detail
