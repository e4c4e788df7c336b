// The dynamic loss scaler's state machine (torch-free).
#include <gtest/gtest.h>

#include "shardopt/error.hpp"
#include "shardopt/precision.hpp"

namespace shardopt {
namespace {

LossScaleOptions small() {
  LossScaleOptions o;
  o.initial_scale = 64;
  o.growth_interval = 3;
  o.hysteresis = 2;
  o.min_scale = 16;
  return o;
}

TEST(LossScaler, GrowsAfterTheIntervalWithoutOverflow) {
  LossScaler s(small());
  EXPECT_FALSE(s.update(false));
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.scale(), 64);
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.scale(), 128);
}

TEST(LossScaler, HysteresisDelaysTheBackoffAndMinScaleBoundsIt) {
  LossScaler s(small());
  EXPECT_TRUE(s.update(true));  // first overflow: skipped, scale kept (hysteresis 2)
  EXPECT_EQ(s.scale(), 64);
  EXPECT_TRUE(s.update(true));  // second: halved
  EXPECT_EQ(s.scale(), 32);
  EXPECT_TRUE(s.update(true));
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 16);
  EXPECT_TRUE(s.update(true));
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 16);  // never below min_scale
  EXPECT_EQ(s.state().overflows, 6);
}

TEST(LossScaler, OverflowRestartsTheGrowthCount) {
  LossScaler s(small());
  s.update(false);
  s.update(false);
  s.update(true);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 64);
  s.update(false);
  EXPECT_EQ(s.scale(), 128);
}

TEST(LossScaler, StaticScaleNeverMovesButStillSkips) {
  LossScaleOptions o = small();
  o.dynamic = false;
  LossScaler s(o);
  EXPECT_TRUE(s.update(true));
  for (int i = 0; i < 10; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 64);
}

TEST(LossScaler, StateRoundTripsAndBadStateIsRefused) {
  LossScaler a(small());
  a.update(true);
  a.update(false);
  LossScaler b(small());
  b.set_state(a.state());
  EXPECT_EQ(b.state().scale, a.state().scale);
  EXPECT_EQ(b.state().good_steps, a.state().good_steps);
  EXPECT_EQ(b.state().hysteresis_left, a.state().hysteresis_left);
  LossScaler::State bad;
  bad.scale = -1;
  EXPECT_THROW(b.set_state(bad), Error);
}

TEST(LossScaler, InvalidOptionsNameTheField) {
  LossScaleOptions o;
  o.backoff_factor = 1.5;
  try {
    o.validate();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("loss_scale.backoff_factor must be in (0, 1), got 1.5"),
              std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shardopt
