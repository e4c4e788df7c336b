// Every invalid ZeroOptions field gives the documented message; the defaults are valid.
#include <gtest/gtest.h>

#include <functional>

#include "shardopt/error.hpp"
#include "shardopt/options.hpp"
#include "shardopt/rules.hpp"
#include "support/expect_error.hpp"

namespace shardopt {
namespace {

void expect_invalid(const std::function<void(ZeroOptions&)>& edit, const std::string& needle) {
  ZeroOptions o;
  edit(o);
  test::expect_error([&] { o.validate(); }, ErrorKind::InvalidArgument, {needle});
}

TEST(ZeroOptions, DefaultsAreValid) { EXPECT_NO_THROW(ZeroOptions{}.validate()); }

TEST(ZeroOptions, EveryInvalidFieldIsNamed) {
  expect_invalid([](auto& o) { o.stage = static_cast<Stage>(-1); }, "stage must be 0, 1, 2 or 3, got -1");
  expect_invalid([](auto& o) { o.stage = static_cast<Stage>(4); }, "stage must be 0, 1, 2 or 3, got 4");
  expect_invalid([](auto& o) { o.bucket_bytes = -5; }, "bucket_bytes must be >= 0 (0: sized from the model), got -5");
  expect_invalid([](auto& o) { o.grad_accumulation_steps = 0; }, "grad_accumulation_steps");
  expect_invalid([](auto& o) { o.max_grad_norm = -1; }, "max_grad_norm must be >= 0");
  expect_invalid([](auto& o) { o.align_bytes = 48; }, "align_bytes must be a positive power of two");
  expect_invalid([](auto& o) { o.prefetch = -1; }, "prefetch must be >= 0");
  expect_invalid([](auto& o) { o.reuse_distance = -3; }, "reuse_distance must be >= 0 (unit uses ahead), got -3");
  expect_invalid([](auto& o) { o.timeout = Duration::zero(); }, "timeout must be positive");
  expect_invalid([](auto& o) { o.shard_group_size = -2; }, "shard_group_size must be >= 0");
  expect_invalid(
      [](auto& o) {
        o.precision = Precision::FP16;
        o.reduce_in_fp32 = false;
        o.reduce_dtype = Precision::BF16;
      },
      "reduce_dtype bf16 contradicts reduce_in_fp32 = false");
}

TEST(ZeroOptions, PrecisionNamesRoundTrip) {
  for (auto p : {Precision::FP32, Precision::FP16, Precision::BF16}) {
    EXPECT_EQ(parse_precision(to_string(p)), p);
  }
  EXPECT_THROW(parse_precision("fp8"), Error);
}

TEST(Rules, FluentSettersAndHelpers) {
  Rule r = AdamW(1e-4).weight_decay(0.05).beta2(0.98);
  EXPECT_STREQ(rule_name(r), "adamw");
  EXPECT_DOUBLE_EQ(rule_lr(r), 1e-4);
  set_rule_lr(r, 3e-4);
  set_rule_weight_decay(r, 0.0);
  EXPECT_DOUBLE_EQ(std::get<AdamW>(r).lr(), 3e-4);
  EXPECT_DOUBLE_EQ(std::get<AdamW>(r).weight_decay(), 0.0);
  EXPECT_DOUBLE_EQ(std::get<AdamW>(r).beta2(), 0.98);
  EXPECT_DOUBLE_EQ(SGD(0.1).momentum(), 0.0);  // torch's defaults
}

}  // namespace
}  // namespace shardopt
