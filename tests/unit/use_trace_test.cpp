// The stage-3 use trace (Note [Use trace] in shardopt/detail/use_trace.hpp), shared by declared and
// automatic units.
#include <gtest/gtest.h>

#include "shardopt/detail/use_trace.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail {
namespace {

// Forward 0 1 2 1 (a tied part used again), backward 1 2 0.
void one_pass(UseTrace& t) {
  for (int id : {0, 1, 1, 2, 1}) t.forward(id);
  for (int id : {1, 1, 2, 0}) t.backward(id);
}

TEST(UseTrace, NextUsesComeFromTheLastPassForwardThenBackward) {
  UseTrace t(3);
  one_pass(t);
  EXPECT_FALSE(t.usable());
  t.end_backward(true);
  EXPECT_TRUE(t.usable());
  EXPECT_EQ(t.previous_at(2), 2);
  EXPECT_EQ(t.previous_at(4), -1);
  // The second pass follows: at position 2 (part 2), part 1 is used next at 3, part 0 at 6
  // (backward: 1 2 0 are positions 4 5 6).
  EXPECT_TRUE(t.forward(0));
  EXPECT_FALSE(t.forward(0));  // a repeat records nothing
  t.forward(1);
  t.forward(2);
  EXPECT_TRUE(t.following());
  EXPECT_EQ(t.position(), 2u);
  EXPECT_EQ(t.next_use(1), 3u);
  EXPECT_EQ(t.next_use(0), 6u);
  t.forward(1);
  EXPECT_EQ(t.next_use(1), 4u);  // its backward use
  EXPECT_EQ(t.next_use(2), 5u);
  t.forward(0);  // leaves the trace
  EXPECT_FALSE(t.following());
}

TEST(UseTrace, BackwardWalksThisForwardInReverse) {
  UseTrace t(4);
  for (int id : {0, 1, 2, 3}) t.forward(id);
  EXPECT_EQ(t.before_in_forward(3, 2), (std::vector<int>{2, 1}));
  EXPECT_EQ(t.before_in_forward(2, 2), (std::vector<int>{1, 0}));
  EXPECT_EQ(t.before_in_forward(3, 2), (std::vector<int>{}));  // already passed
  EXPECT_EQ(t.before_in_forward(1, 0), (std::vector<int>{}));
  EXPECT_EQ(t.before_in_forward(0, 2), (std::vector<int>{}));
}

TEST(UseTrace, DisagreementTurnsItOffForGood) {
  UseTrace a(3), b(3);
  one_pass(a);
  one_pass(b);
  EXPECT_EQ(a.fingerprint(), b.fingerprint());
  b.forward(0);
  EXPECT_NE(a.fingerprint(), b.fingerprint());
  a.end_backward(false);
  EXPECT_TRUE(a.checked());
  EXPECT_FALSE(a.usable());
  one_pass(a);
  a.end_backward(true);  // read the first time only
  EXPECT_FALSE(a.usable());
  a.forward(0);
  EXPECT_FALSE(a.following());
}

// Forwards without a backward (evaluation) start over past 4 * ids + 16 uses.
TEST(UseTrace, EvaluationForwardsStartOver) {
  UseTrace t(3);  // one_pass uses ids 0..2 (this said 2, and ASan found the write past the end)
  one_pass(t);
  t.end_backward(true);
  for (int i = 0; i < 100; ++i) t.forward(i % 2);
  EXPECT_LE(t.position(), 4u * 3 + 16);
  EXPECT_FALSE(t.following());
}

// An id outside the trace is our bug, reported, never a write past the trace's table.
TEST(UseTrace, AnIdOutsideTheTraceIsAnInternalError) {
  UseTrace t(2);
  t.forward(1);
  EXPECT_THROW(t.forward(2), Error);
  EXPECT_THROW(t.forward(-1), Error);
}

}  // namespace
}  // namespace shardopt::detail
