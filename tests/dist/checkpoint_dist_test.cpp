// Checkpoints across ranks: save at N=2 (stage 2), resume on the first 1..W world ranks at every
// stage (bitwise vs the uninterrupted run at the same N and stage, <= 1e-6 otherwise); a save that crashes on rank 1 after
// its shard; a corrupt or missing shard and another model fail on every rank with the same kind,
// leaving every optimizer as it was. Sub-communicators of the first n ranks come from
// Communicator::split, so one mpirun -np 4 covers 1, 2, 3 (uneven shards) and 4.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include "shardopt/checkpoint.hpp"
#include "shardopt/error.hpp"
#include "support/checkpoint_model.hpp"
#include "support/dist_env.hpp"
#include "support/first_ranks.hpp"

namespace shardopt {
namespace {

namespace fs = std::filesystem;
using test::ckpt_rule;
using test::ckpt_train;
using test::CkptNet;
using test::first_ranks;

ZeroOptions zero(int stage, int64_t bucket_bytes = 64) {
  ZeroOptions zo;
  zo.stage = stage_from_int(stage);
  zo.bucket_bytes = bucket_bytes;
  zo.timeout = std::chrono::seconds(60);
  return zo;
}

// What one rank saw when an operation should fail: the kind and message, or none.
struct Outcome {
  bool threw = false;
  ErrorKind kind = ErrorKind::Internal;
  std::string message;
};
template <typename Fn>
Outcome run(Fn&& fn) {
  Outcome o;
  try {
    fn();
  } catch (const Error& e) {
    o = {true, e.kind(), e.what()};
  }
  return o;
}
bool failed_with(const Outcome& o, ErrorKind kind, const std::string& needle) {
  return o.threw && o.kind == kind && o.message.find(needle) != std::string::npos;
}

constexpr int64_t kSaveAt = 3, kEnd = 6;

// Rank 0's tensors on every world rank.
std::map<std::string, at::Tensor> broadcast_from_rank0(std::map<std::string, at::Tensor> values) {
  for (auto& [name, t] : CkptNet().snapshot()) {
    at::Tensor v = test::world()->rank() == 0 ? values.at(name).contiguous() : at::empty_like(t);
    test::world()->broadcast(v, 0);
    values[name] = v;
  }
  return values;
}

// Rank 0 removes a test::shared_dir() once every rank is done with it. Collective over the world.
void remove_shared(const std::string& dir) {
  test::world()->barrier();
  std::error_code ec;
  if (test::world()->rank() == 0) fs::remove_all(dir, ec);
}

TEST(CheckpointDist, ResumesOnEveryWorldSizeAndStage) {
  const int world = test::world()->size();
  const int saver = std::min(2, world);
  const std::string base = test::shared_dir("ckpt-dist");
  const std::string dir = base + "/ckpt";
  // The uninterrupted run at the saver's N and stage 2, saving on the way.
  std::map<std::string, at::Tensor> uninterrupted;
  if (auto comm = first_ranks(saver)) {
    CkptNet net;
    DistributedOptimizer opt(net.groups(), ckpt_rule("adamw"), comm, zero(2));
    ckpt_train(opt, net, 0, kSaveAt);
    save_checkpoint(opt, dir, {R"({"saved_by": "ranks"})", {}});
    ckpt_train(opt, net, kSaveAt, kEnd);
    uninterrupted = net.snapshot();
  }
  uninterrupted = broadcast_from_rank0(uninterrupted);

  bool ok = true;
  for (int n = 1; n <= world; ++n) {
    auto comm = first_ranks(n);
    if (!comm) continue;
    for (int stage : {0, 1, 2, 3}) {
      CkptNet net;
      // Other buckets than the writer's for stage 1: resharding goes through the pieces.
      ZeroOptions zo = zero(stage, stage == 1 ? (1 << 20) : 64);
      zo.units = net.units;  // stage 3: fc1 and fc2 are units, other buckets again
      DistributedOptimizer opt(net.groups(), ckpt_rule("adamw"), comm, zo);
      const TrainerState t = load_checkpoint(opt, dir);
      EXPECT_EQ(opt.last_step().step, kSaveAt);
      EXPECT_NE(t.json.find("\"saved_by\":\"ranks\""), std::string::npos) << t.json;
      ckpt_train(opt, net, kSaveAt, kEnd);
      opt.gather_full_parameters();  // stage 3: units hold no storage between steps
      std::string worst;
      if (n == saver && stage == 2) {
        const bool same = test::ckpt_bitwise_equal(net.snapshot(), uninterrupted, &worst);
        EXPECT_TRUE(same) << "N=" << n << " stage 2 is not bitwise equal at " << worst;
        ok = ok && same;
      } else {
        const double diff = test::ckpt_max_diff(net.snapshot(), uninterrupted, &worst);
        EXPECT_LE(diff, 1e-6) << "N=" << n << " stage " << stage << ", worst " << worst;
        ok = ok && diff <= 1e-6;
      }
    }
  }
  EXPECT_GT(test::ckpt_max_diff(uninterrupted, CkptNet().snapshot(), nullptr), 1e-3);  // trained
  EXPECT_TRUE(test::all_ranks(ok));
  remove_shared(base);
}

// Rank 1 dies right after writing its shard: every rank fails with the same kind, the previous
// checkpoint stays loadable and the partial one is invisible; the next save cleans up.
TEST(CheckpointDist, CrashAfterAShardKeepsThePreviousCheckpoint) {
  if (test::world()->size() < 2) GTEST_SKIP() << "needs two ranks";
  const std::string base = test::shared_dir("ckpt-dist");
  const std::string dir = base + "/ckpt";
  bool ok = true;
  if (auto comm = first_ranks(2)) {
    CkptNet net;
    DistributedOptimizer opt(net.groups(), ckpt_rule("adamw"), comm, zero(2));
    ckpt_train(opt, net, 0, 2);
    save_checkpoint(opt, dir);
    const auto at_two = net.snapshot();
    ckpt_train(opt, net, 2, 4);
    SaveOptions crash;
    crash.simulate_crash_after_shard_on_rank = 1;
    const Outcome o = run([&] { save_checkpoint(opt, dir, {}, crash); });
    const bool same_kind = failed_with(o, ErrorKind::Checkpoint, "simulated crash on rank 1");
    EXPECT_TRUE(same_kind) << o.message;
    if (comm->rank() == 0) {
      EXPECT_NE(o.message.find("failed on rank 1"), std::string::npos) << o.message;
      std::printf("%s\n", o.message.c_str());  // the message users see on the other ranks
    }
    comm->barrier();
    EXPECT_TRUE(fs::exists(base + "/.ckpt.tmp/shard-00001-of-00002.bin"));
    EXPECT_FALSE(fs::exists(base + "/.ckpt.tmp/manifest.json"));
    EXPECT_EQ(read_checkpoint_info(dir).step, 2);
    CkptNet fresh;
    DistributedOptimizer resumed(fresh.groups(), ckpt_rule("adamw"), comm, zero(2));
    load_checkpoint(resumed, dir);
    std::string worst;
    const bool intact = test::ckpt_bitwise_equal(fresh.snapshot(), at_two, &worst);
    EXPECT_TRUE(intact) << worst;
    save_checkpoint(opt, dir);
    comm->barrier();
    EXPECT_EQ(read_checkpoint_info(dir).step, 4);
    EXPECT_FALSE(fs::exists(base + "/.ckpt.tmp"));
    ok = same_kind && intact;
  }
  EXPECT_TRUE(test::all_ranks(ok));
  remove_shared(base);
}

// One flipped byte in rank 1's shard, a missing shard, another model: every rank of the loading
// group throws the same kind, and no rank's optimizer changed.
TEST(CheckpointDist, BadCheckpointsFailOnEveryRank) {
  if (test::world()->size() < 2) GTEST_SKIP() << "needs two ranks";
  const int world = test::world()->size();
  const std::string base = test::shared_dir("ckpt-dist");
  const std::string dir = base + "/ckpt";
  const std::string shard1 = dir + "/shard-00001-of-00002.bin";
  if (auto comm = first_ranks(2)) {
    CkptNet net;
    DistributedOptimizer opt(net.groups(), ckpt_rule("adamw"), comm, zero(2));
    ckpt_train(opt, net, 0, 2);
    save_checkpoint(opt, dir);
    comm->barrier();
    if (comm->rank() == 0) {
      std::fstream f(shard1, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(100);
      const char c = static_cast<char>(f.get() ^ 0x10);
      f.seekp(100);
      f.put(c);
    }
  }
  test::world()->barrier();
  bool ok = true;
  auto comm = first_ranks(world);
  {
    CkptNet net;
    DistributedOptimizer opt(net.groups(), ckpt_rule("adamw"), comm, zero(2));
    const auto before = net.snapshot();
    const Outcome o = run([&] { load_checkpoint(opt, dir); });
    const bool agreed = failed_with(o, ErrorKind::Checkpoint, "checksum mismatch") &&
                        o.message.find(shard1) != std::string::npos;
    EXPECT_TRUE(agreed) << o.message;
    std::string worst;
    EXPECT_TRUE(test::ckpt_bitwise_equal(net.snapshot(), before, &worst)) << worst;
    EXPECT_EQ(opt.last_step().step, 0);
    ok = ok && agreed;
    if (comm->rank() == 0) std::printf("%s\n", o.message.c_str());
  }
  test::world()->barrier();
  if (test::world()->rank() == 0) fs::remove(shard1);
  test::world()->barrier();
  {
    CkptNet net;
    DistributedOptimizer opt(net.groups(), ckpt_rule("adamw"), comm, zero(1));
    const Outcome o = run([&] { load_checkpoint(opt, dir); });
    const bool agreed = failed_with(o, ErrorKind::Checkpoint, "is missing") &&
                        o.message.find(shard1) != std::string::npos;
    EXPECT_TRUE(agreed) << o.message;
    ok = ok && agreed;
  }
  {
    CkptNet net(/*hidden=*/8);
    DistributedOptimizer opt(net.groups(), ckpt_rule("adamw"), comm, zero(2));
    const Outcome o = run([&] { load_checkpoint(opt, dir); });
    const bool agreed = failed_with(o, ErrorKind::Mismatch, "'fc2.weight' has shape [8, 6]");
    EXPECT_TRUE(agreed) << o.message;
    ok = ok && agreed;
  }
  EXPECT_TRUE(test::all_ranks(ok));
  remove_shared(base);
}

// fp16 with a dynamic loss scaler: the fp32 master weights are what a checkpoint holds, and the
// scaler's state (scale, steps since the last growth) continues where it was: with a growth
// interval of 2 the scales of the resumed steps must equal the uninterrupted run's.
TEST(CheckpointDist, Fp16MasterWeightsAndLossScalerSurvive) {
  const int saver = std::min(2, test::world()->size());
  const std::string base = test::shared_dir("ckpt-dist");
  const std::string dir = base + "/ckpt";
  bool ok = true;
  if (auto comm = first_ranks(saver)) {
    auto fp16 = [](CkptNet& net, int stage) {
      net.upcast = true;
      ZeroOptions zo = zero(stage);
      zo.units = net.units;
      zo.precision = Precision::FP16;
      zo.loss_scale.initial_scale = 256;
      zo.loss_scale.growth_interval = 2;
      return zo;
    };
    auto train = [](DistributedOptimizer& opt, CkptNet& net, int64_t from, int64_t to,
                    std::vector<double>& scales) {
      for (int64_t s = from; s < to; ++s) {
        ckpt_train(opt, net, s, s + 1);
        EXPECT_FALSE(opt.last_step().skipped);
        scales.push_back(opt.last_step().loss_scale);
      }
    };
    std::vector<double> scales;
    CkptNet net;
    DistributedOptimizer opt(net.groups(), ckpt_rule("adamw"), comm, fp16(net, 2));
    train(opt, net, 0, kSaveAt, scales);
    save_checkpoint(opt, dir);
    train(opt, net, kSaveAt, kEnd, scales);
    const auto uninterrupted = net.snapshot();
    const std::vector<double> tail(scales.begin() + kSaveAt, scales.end());
    EXPECT_NE(tail.front(), tail.back()) << "the scale must grow during the resumed steps";
    for (int stage : {2, 3}) {
      CkptNet resumed_net;
      DistributedOptimizer resumed(resumed_net.groups(), ckpt_rule("adamw"), comm,
                                   fp16(resumed_net, stage));
      load_checkpoint(resumed, dir);
      std::vector<double> resumed_scales;
      train(resumed, resumed_net, kSaveAt, kEnd, resumed_scales);
      resumed.gather_full_parameters();
      EXPECT_EQ(resumed_scales, tail) << "stage " << stage;
      std::string worst;
      const double diff = test::ckpt_max_diff(resumed_net.snapshot(), uninterrupted, &worst);
      EXPECT_LE(diff, 1e-6) << "stage " << stage << ", worst " << worst;
      ok = ok && resumed_scales == tail && diff <= 1e-6;
    }
    const CheckpointInfo info = read_checkpoint_info(dir);
    EXPECT_EQ(info.precision, "fp16");
  }
  EXPECT_TRUE(test::all_ranks(ok));
  remove_shared(base);
}

}  // namespace
}  // namespace shardopt
