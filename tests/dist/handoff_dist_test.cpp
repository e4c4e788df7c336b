// A checkpoint handed from one launch to another, as a job that moves between machines does
// (tests/multihost/checkpoint_handoff.sh: saved by 2 hosts x 2 ranks, flat or hybrid, resumed by
// 1 host x 3). SHARDOPT_HANDOFF_DIR names a directory both launches see; without it Save and
// Resume skip. SHARDOPT_HANDOFF_SHARD_GROUP (0) is the saver's ZeroOptions::shard_group_size.
//   Save:   steps [0, 3), save <dir>/mid, steps [3, 6), save <dir>/end (stage 2, 64-byte buckets).
//   Resume: <dir>/mid at every stage on this launch's ranks, steps [3, 6); the parameters must
//           equal <dir>/end loaded into a fresh model within 1e-6.
// HybridAndFlatReshardInOneLaunch: flat -> hybrid and hybrid -> flat on one launch's ranks.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "shardopt/checkpoint.hpp"
#include "support/checkpoint_model.hpp"
#include "support/dist_env.hpp"

namespace shardopt {
namespace {

namespace fs = std::filesystem;
using test::ckpt_rule;
using test::ckpt_train;
using test::CkptNet;

constexpr int64_t kSaveAt = 3, kEnd = 6;

std::string handoff_dir() {
  const char* dir = std::getenv("SHARDOPT_HANDOFF_DIR");
  return dir ? dir : "";
}

ZeroOptions zero(int stage, const CkptNet& net, int shard_group = 0) {
  ZeroOptions zo;
  zo.shard_group_size = shard_group;
  zo.stage = stage_from_int(stage);
  zo.bucket_bytes = 64;
  zo.units = net.units;
  zo.timeout = std::chrono::seconds(60);
  return zo;
}

TEST(CheckpointHandoff, Save) {
  const std::string dir = handoff_dir();
  if (dir.empty()) GTEST_SKIP() << "SHARDOPT_HANDOFF_DIR is not set (tests/multihost sets it)";
  auto comm = test::world();
  if (comm->rank() == 0) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  comm->barrier();
  const char* group_env = std::getenv("SHARDOPT_HANDOFF_SHARD_GROUP");
  const int group = group_env ? std::atoi(group_env) : 0;
  CkptNet net;
  DistributedOptimizer opt(net.groups(), ckpt_rule("adamw"), comm, zero(2, net, group));
  ckpt_train(opt, net, 0, kSaveAt);
  save_checkpoint(opt, dir + "/mid");
  ckpt_train(opt, net, kSaveAt, kEnd);
  save_checkpoint(opt, dir + "/end");
  // A hybrid checkpoint is that of one shard group.
  EXPECT_EQ(read_checkpoint_info(dir + "/end").world_size, group > 0 ? group : comm->size());
}

TEST(CheckpointHandoff, Resume) {
  const std::string dir = handoff_dir();
  if (dir.empty()) GTEST_SKIP() << "SHARDOPT_HANDOFF_DIR is not set (tests/multihost sets it)";
  auto comm = test::world();
  std::map<std::string, at::Tensor> expected;
  {
    CkptNet net;
    DistributedOptimizer opt(net.groups(), ckpt_rule("adamw"), comm, zero(2, net));
    load_checkpoint(opt, dir + "/end");
    EXPECT_EQ(opt.last_step().step, kEnd);
    expected = net.snapshot();
  }
  const int saved_by = read_checkpoint_info(dir + "/mid").world_size;
  EXPECT_NE(saved_by, comm->size()) << "the handoff should change the world size";
  bool ok = true;
  for (int stage : {0, 1, 2, 3}) {
    CkptNet net;
    DistributedOptimizer opt(net.groups(), ckpt_rule("adamw"), comm, zero(stage, net));
    load_checkpoint(opt, dir + "/mid");
    EXPECT_EQ(opt.last_step().step, kSaveAt);
    ckpt_train(opt, net, kSaveAt, kEnd);
    opt.gather_full_parameters();
    std::string worst;
    const double diff = test::ckpt_max_diff(net.snapshot(), expected, &worst);
    EXPECT_LE(diff, 1e-6) << "saved by " << saved_by << " ranks, resumed by " << comm->size()
                          << " at stage " << stage << ", worst " << worst;
    ok = ok && diff <= 1e-6;
  }
  EXPECT_GT(test::ckpt_max_diff(expected, CkptNet().snapshot(), nullptr), 1e-3);  // trained
  EXPECT_TRUE(test::all_ranks(ok));
}


// Flat (all ranks) and hybrid (shard groups of 2) checkpoints load into each other at every
// stage and continue the uninterrupted flat run's trajectory (<= 1e-6).
TEST(CheckpointHandoff, HybridAndFlatReshardInOneLaunch) {
  auto comm = test::world();
  const int n = comm->size();
  if (n % 2 != 0 || n == 2) GTEST_SKIP() << "needs several shard groups of 2 ranks";
  const std::string dir = test::shared_dir("handoff");
  std::map<std::string, at::Tensor> expected;
  {
    CkptNet net;
    DistributedOptimizer opt(net.groups(), ckpt_rule("adamw"), comm, zero(2, net));
    ckpt_train(opt, net, 0, kSaveAt);
    save_checkpoint(opt, dir + "/flat");
    ckpt_train(opt, net, kSaveAt, kEnd);
    expected = net.snapshot();
  }
  {
    CkptNet net;
    DistributedOptimizer opt(net.groups(), ckpt_rule("adamw"), comm, zero(3, net, 2));
    ckpt_train(opt, net, 0, kSaveAt);
    save_checkpoint(opt, dir + "/hybrid");
  }
  EXPECT_EQ(read_checkpoint_info(dir + "/hybrid").world_size, 2);
  bool ok = true;
  for (const char* from : {"flat", "hybrid"}) {
    for (int stage : {0, 1, 2, 3}) {
      // Into the other layout: flat -> hybrid, hybrid -> flat.
      const int group = std::string(from) == "flat" ? 2 : 0;
      CkptNet net;
      DistributedOptimizer opt(net.groups(), ckpt_rule("adamw"), comm, zero(stage, net, group));
      load_checkpoint(opt, dir + "/" + from);
      ckpt_train(opt, net, kSaveAt, kEnd);
      opt.gather_full_parameters();
      std::string worst;
      const double diff = test::ckpt_max_diff(net.snapshot(), expected, &worst);
      EXPECT_LE(diff, 1e-6) << from << " -> stage " << stage << " shard group " << group
                            << ", worst " << worst;
      ok = ok && diff <= 1e-6;
    }
  }
  EXPECT_TRUE(test::all_ranks(ok));
  comm->barrier();
  if (comm->rank() == 0) fs::remove_all(dir);
}

}  // namespace
}  // namespace shardopt
