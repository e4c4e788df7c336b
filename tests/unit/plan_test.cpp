// StagePlan: every combination of stage, precision, offload and parameter device, row by row.
#include "shardopt/detail/plan.hpp"

#include <gtest/gtest.h>

#include <tuple>
#include <vector>

namespace shardopt::detail {
namespace {

using O = StagePlan::Ownership;
using G = StagePlan::Gradients;
using P = StagePlan::Parameters;
using M = StagePlan::Master;

struct Row {
  Stage stage;
  Precision precision;
  Offload offload;
  bool params_on_host;
  O ownership;
  G gradients;
  P parameters;
  M master;
};

// Stage 0 replicates; stage 3 gathers per unit; fp16/bf16 and a move to the host need a separate
// master; stages 2-3, mixed precision and offload take gradients out of autograd per bucket.
const std::vector<Row> kTable = {
    {Stage::Replicated, Precision::FP32, Offload::None, true, O::Replicated, G::InPlace, P::Whole, M::Model},
    {Stage::Replicated, Precision::FP32, Offload::None, false, O::Replicated, G::InPlace, P::Whole, M::Model},
    {Stage::Replicated, Precision::FP32, Offload::CPU, true, O::Replicated, G::Bucketed, P::Whole, M::Model},
    {Stage::Replicated, Precision::FP32, Offload::CPU, false, O::Replicated, G::Bucketed, P::Whole, M::Separate},
    {Stage::Replicated, Precision::BF16, Offload::None, true, O::Replicated, G::Bucketed, P::Whole, M::Separate},
    {Stage::Replicated, Precision::BF16, Offload::None, false, O::Replicated, G::Bucketed, P::Whole, M::Separate},
    {Stage::Replicated, Precision::BF16, Offload::CPU, true, O::Replicated, G::Bucketed, P::Whole, M::Separate},
    {Stage::Replicated, Precision::BF16, Offload::CPU, false, O::Replicated, G::Bucketed, P::Whole, M::Separate},
    {Stage::Replicated, Precision::FP16, Offload::None, true, O::Replicated, G::Bucketed, P::Whole, M::Separate},
    {Stage::Replicated, Precision::FP16, Offload::None, false, O::Replicated, G::Bucketed, P::Whole, M::Separate},
    {Stage::Replicated, Precision::FP16, Offload::CPU, true, O::Replicated, G::Bucketed, P::Whole, M::Separate},
    {Stage::Replicated, Precision::FP16, Offload::CPU, false, O::Replicated, G::Bucketed, P::Whole, M::Separate},
    {Stage::OptimizerState, Precision::FP32, Offload::None, true, O::Sharded, G::InPlace, P::Whole, M::Model},
    {Stage::OptimizerState, Precision::FP32, Offload::None, false, O::Sharded, G::InPlace, P::Whole, M::Model},
    {Stage::OptimizerState, Precision::FP32, Offload::CPU, true, O::Sharded, G::Bucketed, P::Whole, M::Model},
    {Stage::OptimizerState, Precision::FP32, Offload::CPU, false, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::OptimizerState, Precision::BF16, Offload::None, true, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::OptimizerState, Precision::BF16, Offload::None, false, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::OptimizerState, Precision::BF16, Offload::CPU, true, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::OptimizerState, Precision::BF16, Offload::CPU, false, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::OptimizerState, Precision::FP16, Offload::None, true, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::OptimizerState, Precision::FP16, Offload::None, false, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::OptimizerState, Precision::FP16, Offload::CPU, true, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::OptimizerState, Precision::FP16, Offload::CPU, false, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::Gradients, Precision::FP32, Offload::None, true, O::Sharded, G::Bucketed, P::Whole, M::Model},
    {Stage::Gradients, Precision::FP32, Offload::None, false, O::Sharded, G::Bucketed, P::Whole, M::Model},
    {Stage::Gradients, Precision::FP32, Offload::CPU, true, O::Sharded, G::Bucketed, P::Whole, M::Model},
    {Stage::Gradients, Precision::FP32, Offload::CPU, false, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::Gradients, Precision::BF16, Offload::None, true, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::Gradients, Precision::BF16, Offload::None, false, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::Gradients, Precision::BF16, Offload::CPU, true, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::Gradients, Precision::BF16, Offload::CPU, false, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::Gradients, Precision::FP16, Offload::None, true, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::Gradients, Precision::FP16, Offload::None, false, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::Gradients, Precision::FP16, Offload::CPU, true, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::Gradients, Precision::FP16, Offload::CPU, false, O::Sharded, G::Bucketed, P::Whole, M::Separate},
    {Stage::Parameters, Precision::FP32, Offload::None, true, O::Sharded, G::Bucketed, P::PerPart, M::Model},
    {Stage::Parameters, Precision::FP32, Offload::None, false, O::Sharded, G::Bucketed, P::PerPart, M::Model},
    {Stage::Parameters, Precision::FP32, Offload::CPU, true, O::Sharded, G::Bucketed, P::PerPart, M::Model},
    {Stage::Parameters, Precision::FP32, Offload::CPU, false, O::Sharded, G::Bucketed, P::PerPart, M::Separate},
    {Stage::Parameters, Precision::BF16, Offload::None, true, O::Sharded, G::Bucketed, P::PerPart, M::Separate},
    {Stage::Parameters, Precision::BF16, Offload::None, false, O::Sharded, G::Bucketed, P::PerPart, M::Separate},
    {Stage::Parameters, Precision::BF16, Offload::CPU, true, O::Sharded, G::Bucketed, P::PerPart, M::Separate},
    {Stage::Parameters, Precision::BF16, Offload::CPU, false, O::Sharded, G::Bucketed, P::PerPart, M::Separate},
    {Stage::Parameters, Precision::FP16, Offload::None, true, O::Sharded, G::Bucketed, P::PerPart, M::Separate},
    {Stage::Parameters, Precision::FP16, Offload::None, false, O::Sharded, G::Bucketed, P::PerPart, M::Separate},
    {Stage::Parameters, Precision::FP16, Offload::CPU, true, O::Sharded, G::Bucketed, P::PerPart, M::Separate},
    {Stage::Parameters, Precision::FP16, Offload::CPU, false, O::Sharded, G::Bucketed, P::PerPart, M::Separate},
};

TEST(StagePlan, EveryCombination) {
  ASSERT_EQ(kTable.size(), 4u * 3u * 2u * 2u);
  for (const auto& r : kTable) {
    const auto p = StagePlan::make(r.stage, r.precision, r.offload, r.params_on_host);
    const auto where = ::testing::Message()
                       << "stage " << to_int(r.stage) << ", precision " << to_string(r.precision)
                       << ", offload " << (r.offload == Offload::CPU) << ", params on host "
                       << r.params_on_host;
    EXPECT_EQ(p.ownership, r.ownership) << where;
    EXPECT_EQ(p.gradients, r.gradients) << where;
    EXPECT_EQ(p.parameters, r.parameters) << where;
    EXPECT_EQ(p.master, r.master) << where;
    EXPECT_EQ(p.mixed, r.precision != Precision::FP32) << where;
    EXPECT_EQ(p.loss_scaling, r.precision == Precision::FP16) << where;
    EXPECT_EQ(p.master_on_host, r.offload == Offload::CPU) << where;
    EXPECT_EQ(p.reduces_every_micro_step(), r.gradients == G::Bucketed) << where;
    EXPECT_EQ(p.gathers_after_update(), r.ownership == O::Sharded && r.parameters == P::Whole)
        << where;
  }
}

// A reduction in another dtype (ZeroOptions::reduce_dtype) casts into buckets: every combination
// buckets its gradients and keeps everything else the table says.
TEST(StagePlan, ReduceInAnotherDtypeBuckets) {
  for (const auto& r : kTable) {
    const auto p = StagePlan::make(r.stage, r.precision, r.offload, r.params_on_host, true);
    EXPECT_EQ(p.gradients, G::Bucketed) << "stage " << to_int(r.stage);
    EXPECT_EQ(p.ownership, r.ownership);
    EXPECT_EQ(p.parameters, r.parameters);
    EXPECT_EQ(p.master, r.master);
  }
}

TEST(StagePlan, StageFromInt) {
  for (int s = 0; s <= 3; ++s) EXPECT_EQ(to_int(stage_from_int(s)), s);
}

// Note [Default bucket size]: explicit bytes as given; the default at most 16 MiB and at most a
// quarter of the gradient elements a rank frees; one rank frees nothing and keeps 16 MiB.
TEST(StagePlan, DefaultBucketSize) {
  EXPECT_EQ(bucket_numel(64, 1000, 2, 4), 16);
  EXPECT_EQ(bucket_numel(2, 1000, 2, 4), 1);
  EXPECT_EQ(bucket_numel(0, 1'000'000'000, 2, 4), (16 << 20) / 4);
  EXPECT_EQ(bucket_numel(0, 1'000'000'000, 1, 4), (16 << 20) / 4);
  EXPECT_EQ(bucket_numel(0, 11'201'594, 2, 4), 11'201'594 / 2 / 4);  // the peer BERT
  EXPECT_EQ(bucket_numel(0, 8'000'000, 4, 2), 8'000'000 / 4 * 3 / 4);
  EXPECT_EQ(bucket_numel(0, 3, 2, 4), 1);
  static_assert(bucket_numel(0, 0, 8, 4) == 1, "never an empty bucket");
}

}  // namespace
}  // namespace shardopt::detail
