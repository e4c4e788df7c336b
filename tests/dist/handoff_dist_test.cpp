// A checkpoint handed from one launch to another, as a job that moves between machines does
// (tests/multihost/checkpoint_handoff.sh: saved by 2 hosts x 2 ranks, resumed by 1 host x 3).
// SHARDOPT_HANDOFF_DIR names a directory both launches see; without it these tests skip.
//   Save:   steps [0, 3), save <dir>/mid, steps [3, 6), save <dir>/end (stage 2, 64-byte buckets).
//   Resume: <dir>/mid at every stage on this launch's ranks, steps [3, 6); the parameters must
//           equal <dir>/end loaded into a fresh model within 1e-6.
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

ZeroOptions zero(int stage, const CkptNet& net) {
  ZeroOptions zo;
  zo.stage = stage;
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
  CkptNet net;
  DistributedOptimizer opt(net.groups(), ckpt_rule("adamw"), comm, zero(2, net));
  ckpt_train(opt, net, 0, kSaveAt);
  save_checkpoint(opt, dir + "/mid");
  ckpt_train(opt, net, kSaveAt, kEnd);
  save_checkpoint(opt, dir + "/end");
  EXPECT_EQ(read_checkpoint_info(dir + "/end").world_size, comm->size());
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

}  // namespace
}  // namespace shardopt
