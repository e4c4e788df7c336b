// Each rule's own declaration (Note [One place per rule]) feeds the state buffers the engine keeps
// and the checkpoint JSON codec; the JSON is what earlier versions wrote, byte for byte.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "checkpoint/format.hpp"
#include "shardopt/detail/rule_traits.hpp"
#include "shardopt/error.hpp"
#include "shardopt/rules.hpp"

namespace shardopt {
namespace {

using Names = std::vector<std::string>;

TEST(RuleTraits, StateNamesFollowTheHyperParameters) {
  const std::vector<std::pair<Rule, Names>> cases = {
      {AdamW(), {"exp_avg", "exp_avg_sq"}},
      {AdamW().amsgrad(true), {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}},
      {Adam().amsgrad(true), {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}},
      {SGD(0.1), {}},
      {SGD(0.1).momentum(0.9), {"momentum_buffer"}},
      {Adagrad(), {"sum"}},
      {RMSprop(), {"square_avg"}},
      {RMSprop().momentum(0.5).centered(true), {"square_avg", "momentum_buffer", "grad_avg"}},
      {Lamb(), {"exp_avg", "exp_avg_sq"}},
      {Adafactor(), {"factored_variance"}},
      {AdamW8bit(), {"state1", "state2", "absmax1", "absmax2", "state1_fp32", "state2_fp32"}},
      {Muon(), {"momentum_buffer", "exp_avg_sq"}},
  };
  for (const auto& [rule, names] : cases) {
    EXPECT_EQ(detail::state_names(rule), names) << rule_name(rule);
    EXPECT_EQ(detail::state_count(rule), static_cast<int>(names.size())) << rule_name(rule);
  }
}

TEST(RuleTraits, NamesInTheOrderOfRule) {
  EXPECT_EQ(detail::rule_names(), (Names{"adamw", "adam", "sgd", "adagrad", "rmsprop", "lamb", "adafactor",
                                          "adamw8bit", "muon"}));
  std::string seen;
  EXPECT_TRUE(detail::with_rule_named("rmsprop", [&](auto type) {
    seen = decltype(type)::type::kName;
  }));
  EXPECT_EQ(seen, "rmsprop");
  EXPECT_FALSE(detail::with_rule_named("adamax", [](auto) {}));
}

TEST(RuleTraits, MuonChecksItsCodes) {
  EXPECT_EQ(detail::rule_problem(Muon()), "");
  EXPECT_NE(detail::rule_problem(Muon().ns_steps(2.5)).find("ns_steps must be an integer"),
            std::string::npos);
  EXPECT_NE(detail::rule_problem(Muon().ns_steps(100)).find("[0, 100)"), std::string::npos);
  EXPECT_NE(detail::rule_problem(Muon().adjust_lr_fn(3)).find("not supported"), std::string::npos);
  EXPECT_NE(detail::rule_problem(Muon().ns_dtype(8)).find("ns_dtype must be 16"), std::string::npos);
  EXPECT_NE(detail::rule_problem(Muon().adamw_beta2(1.0)).find("adamw_beta1 and adamw_beta2"),
            std::string::npos);
}

TEST(RuleTraits, SgdNesterovNeedsMomentumAndNoDampening) {
  EXPECT_EQ(detail::rule_problem(SGD(0.1).momentum(0.9).nesterov(true)), "");
  EXPECT_NE(detail::rule_problem(SGD(0.1).nesterov(true)).find("requires a momentum"),
            std::string::npos);
  EXPECT_EQ(detail::rule_problem(AdamW()), "");
  EXPECT_EQ(detail::rule_problem(Adafactor()), "");
  EXPECT_NE(detail::rule_problem(Adafactor().beta2_decay(0.5)).find("beta2_decay should be <= 0"),
            std::string::npos);
}

// Adafactor's eps is torch's pair (eps1, eps2); a negative eps1 is torch's None.
TEST(RuleTraits, AdafactorEpsIsOnePairForTorch) {
  std::vector<std::string> names;
  std::pair<double, double> eps{0, 0};
  detail::visit_torch_options(Adafactor().eps2(2e-3), [&](const char* name, const auto& value) {
    names.push_back(name);
    if constexpr (std::is_same_v<std::decay_t<decltype(value)>, std::pair<double, double>>) {
      eps = value;
    }
  });
  EXPECT_EQ(names, (Names{"lr", "beta2_decay", "eps", "d", "weight_decay", "maximize"}));
  EXPECT_EQ(eps, std::make_pair(-1.0, 2e-3));
}

TEST(RuleJson, DefaultsAsEarlierVersionsWroteThem) {
  const std::vector<std::pair<Rule, std::string>> cases = {
      {AdamW(),
       R"({"amsgrad":false,"beta1":0.9,"beta2":0.999,"eps":1e-08,"lr":0.001,"rule":"adamw",)"
       R"("weight_decay":0.01})"},
      {Adam(),
       R"({"amsgrad":false,"beta1":0.9,"beta2":0.999,"eps":1e-08,"lr":0.001,"rule":"adam",)"
       R"("weight_decay":0.0})"},
      {SGD(0.1),
       R"({"dampening":0.0,"lr":0.1,"momentum":0.0,"nesterov":false,"rule":"sgd",)"
       R"("weight_decay":0.0})"},
      {Adagrad(),
       R"({"eps":1e-10,"initial_accumulator_value":0.0,"lr":0.01,"lr_decay":0.0,)"
       R"("rule":"adagrad","weight_decay":0.0})"},
      {RMSprop(),
       R"({"alpha":0.99,"centered":false,"eps":1e-08,"lr":0.01,"momentum":0.0,"rule":"rmsprop",)"
       R"("weight_decay":0.0})"},
      {Lamb(),
       R"({"beta1":0.9,"beta2":0.999,"eps":1e-06,"lr":0.001,"rule":"lamb","weight_decay":0.0})"},
      {Adafactor(),
       R"({"beta2_decay":-0.8,"d":1.0,"eps1":-1.0,"eps2":0.001,"lr":0.01,"maximize":false,)"
       R"("rule":"adafactor","weight_decay":0.0})"},
  };
  for (const auto& [rule, text] : cases) EXPECT_EQ(detail::dump(detail::rule_to_json(rule)), text);
}

TEST(RuleJson, RoundTripKeepsEveryField) {
  const std::vector<Rule> rules = {
      AdamW(0.1).beta1(0.8).beta2(0.95).eps(1e-7).weight_decay(0.2).amsgrad(true),
      Adam(0.1).beta1(0.8).beta2(0.95).eps(1e-7).weight_decay(0.2),
      SGD(0.3).momentum(0.9).dampening(-0.5).weight_decay(0.1).nesterov(true),
      Adagrad(0.2).lr_decay(0.01).weight_decay(0.3).initial_accumulator_value(0.4).eps(1e-9),
      RMSprop(0.2).alpha(0.9).eps(1e-6).weight_decay(0.1).momentum(0.3).centered(true),
      Lamb(0.2).beta1(0.7).beta2(0.9).eps(1e-5).weight_decay(0.05),
      Adafactor(0.2).beta2_decay(-0.5).eps1(1e-30).eps2(1e-4).d(2).weight_decay(0.1)
          .maximize(true),
      AdamW8bit(0.2).beta1(0.8).beta2(0.95).eps(1e-7).weight_decay(0.2).min_8bit_size(100),
      Muon(0.02).weight_decay(0.05).momentum(0.9).nesterov(false).ns_a(3).ns_b(-3.2).ns_c(1.2)
          .eps(1e-9).ns_steps(4).adjust_lr_fn(Muon::kSpectralUnclamped).ns_dtype(32)
          .use_muon(false).adamw_beta1(0.8).adamw_beta2(0.95).adamw_eps(1e-6)};
  for (const Rule& rule : rules) {
    const detail::json j = detail::rule_to_json(rule);
    const Rule back = detail::rule_from_json(j);
    EXPECT_EQ(back.index(), rule.index());
    EXPECT_EQ(detail::rule_to_json(back), j);
  }
  EXPECT_THROW(detail::rule_from_json({{"rule", "adamax"}}), Error);
  EXPECT_THROW(detail::rule_from_json({{"rule", "sgd"}, {"lr", 0.1}}), detail::json::exception);
}

}  // namespace
}  // namespace shardopt
