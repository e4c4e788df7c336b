// In-memory snapshots restored at another world size (Note [Snapshots at another world size] in
// shardopt/snapshot.hpp): saved at N ranks over emulated hosts (a directory each), restored at M
// after a host is lost or a new one joins (4 -> 2, 2 -> 4, 4 -> 3, 3 -> 2, 2 -> 1, 1 -> 2 where
// the world has the ranks; and 4 -> 4 with every rank on the surviving host), stages 0-3, AdamW,
// SGD and LAMB (per-tensor norms over other partitions). The continued run equals bitwise the run
// that resumed from a checkpoint on disk saved at the same step (the same resharding), and is
// within 1e-4 of the run at M that was never interrupted. A record lost on every host is refused
// with the reason (nullopt); a corrupt one fails by name on every rank, no optimizer changed.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "shardopt/checkpoint.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/snapshot.hpp"
#include "support/dist_env.hpp"
#include "support/expect_error.hpp"
#include "support/first_ranks.hpp"
#include "support/tiny_net.hpp"

namespace shardopt {
namespace {

namespace fs = std::filesystem;
constexpr int64_t kSaveAt = 3, kEnd = 6;

struct Run {
  test::TinyNet net;
  CommunicatorPtr comm;
  std::unique_ptr<DistributedOptimizer> opt;
  Run(const CommunicatorPtr& c, int stage, const std::string& rule, bool wider = false,
      int shard_group = 0)
      : net(wider), comm(c) {
    ZeroOptions zo;
    zo.shard_group_size = shard_group;
    zo.stage = stage_from_int(stage);
    zo.units = net.units;
    zo.bucket_bytes = 4 * 24;  // parameters split across buckets and ranks
    zo.timeout = std::chrono::seconds(60);
    opt = std::make_unique<DistributedOptimizer>(net.groups(true), test::make_rule(rule), comm, zo);
  }
  void steps(int64_t from, int64_t to) {
    const int64_t rows = test::kBatch / comm->size(), r0 = comm->rank() * rows;
    for (int64_t s = from; s < to; ++s) {
      auto [x, y] = test::batch(s, 0);
      opt->zero_grad();
      opt->backward(net.loss(x.narrow(0, r0, rows), y.narrow(0, r0, rows)));
      opt->step();
    }
  }
  std::map<std::string, at::Tensor> params() {
    opt->gather_full_parameters();  // stage 3: units hold no storage between steps
    std::map<std::string, at::Tensor> out;
    for (auto& [name, t] : net.named) out[name] = t.detach().clone();
    return out;
  }
};

// Rank r's trainer state: its own JSON and tensor, so that the test sees whose it gets.
TrainerState trainer_of(int rank, int64_t step) {
  return {fmt::format(R"({{"rank": {}, "step": {}}})", rank, step),
          {{"rng", at::arange(4, at::kByte) + static_cast<uint8_t>(10 * rank + step)}}};
}

// One change of world: saved at `n` ranks, `n_per_host` a host; `lost` host's directory removed;
// restored at `m` ranks whose directories are `dirs` (host names; a new one holds nothing).
struct Case {
  int n, n_per_host, m, m_per_host;
  int lost;  // -1: none
  std::vector<std::string> dirs;
  int from_copies;  // records served from a buddy's copy
};

std::vector<Case> cases() {
  return {{4, 2, 2, 2, 1, {"host-0", "host-0"}, 2},
          {2, 1, 4, 2, -1, {"host-0", "host-0", "host-2", "host-2"}, 1},
          {4, 2, 3, 3, 1, {"host-0", "host-0", "host-0"}, 2},
          {3, 1, 2, 1, 2, {"host-0", "host-1"}, 1},
          {2, 1, 1, 1, 1, {"host-0"}, 1},
          {1, 1, 2, 1, -1, {"host-0", "host-1"}, 0},
          // The same size, every rank on the surviving host: records found where they are.
          {4, 2, 4, 4, 1, {"host-0", "host-0", "host-0", "host-0"}, 2}};
}

std::string describe(const Case& c) {
  return fmt::format("N={} ({} a host) -> M={} ({} a host){}", c.n, c.n_per_host, c.m, c.m_per_host,
                     c.lost >= 0 ? fmt::format(", host {} lost", c.lost) : "");
}

// Saves snapshots at every step up to kSaveAt at N (and a disk checkpoint at kSaveAt), then takes
// one more step, lost with the job.
void save_at_n(const Case& c, const std::string& base, int stage, const std::string& rule) {
  auto comm = test::first_ranks(c.n);
  if (comm) {
    Run run(comm, stage, rule);
    MemorySnapshots snaps(
        *run.opt, comm,
        {fmt::format("{}/host-{}", base, comm->rank() / c.n_per_host), c.n_per_host});
    for (int64_t s = 0; s < kSaveAt; ++s) {
      run.steps(s, s + 1);
      snaps.snapshot(trainer_of(comm->rank(), s + 1));
    }
    snaps.wait();
    save_checkpoint(*run.opt, base + "/disk", trainer_of(comm->rank(), kSaveAt));
    run.steps(kSaveAt, kSaveAt + 1);
  }
  test::world()->barrier();
  if (test::world()->rank() == 0 && c.lost >= 0)
    fs::remove_all(fmt::format("{}/host-{}", base, c.lost));
  test::world()->barrier();
}

DIST_TEST(SnapshotReshard, ContinuesAtAnotherWorldSize) {
  const int world = test::world()->size();
  if (world < 2) GTEST_SKIP() << "needs 2 ranks or more";
  bool ok = true;
  for (const Case& c : cases()) {
    if (std::max(c.n, c.m) > world) continue;
    for (const std::string rule : {"adamw", "sgd", "lamb"}) {
      for (int stage = 0; stage <= 3; ++stage) {
        SCOPED_TRACE(fmt::format("{}, {} stage {}", describe(c), rule, stage));
        const std::string base = test::shared_dir("snapshot-reshard");
        save_at_n(c, base, stage, rule);
        auto comm = test::first_ranks(c.m);
        // A lambda: an ASSERT leaves it on every rank of `comm` alike, never the barrier below.
        auto restart_at_m = [&] {
          const int r = comm->rank();
          // The run at M that was never interrupted, and the one resumed from the disk checkpoint.
          Run whole(comm, stage, rule);
          whole.steps(0, kEnd);
          const auto uninterrupted = whole.params();
          Run disk(comm, stage, rule);
          load_checkpoint(*disk.opt, base + "/disk");
          disk.steps(kSaveAt, kEnd);
          const auto from_disk = disk.params();
          // The restart at M from memory.
          Run again(comm, stage, rule);
          MemorySnapshots snaps(*again.opt, comm,
                                {base + "/" + c.dirs[static_cast<size_t>(r)], c.m_per_host});
          RestoreReport report;
          const auto t = snaps.restore(&report);
          ok = ok && t.has_value();  // nullopt on every rank alike
          ASSERT_TRUE(t.has_value()) << report.reason;
          EXPECT_EQ(report.number, kSaveAt - 1);
          EXPECT_EQ(report.step, kSaveAt);
          EXPECT_EQ(report.from_buddy, c.from_copies);
          EXPECT_EQ(report.saved_world, c.n);
          EXPECT_EQ(again.opt->last_step().step, kSaveAt);
          // Old rank 0's JSON everywhere; old rank r's tensors on rank r, as from disk.
          EXPECT_EQ(t->json, trainer_of(0, kSaveAt).json);
          if (r < c.n) {
            ASSERT_EQ(t->tensors.count("rng"), 1u);
            EXPECT_TRUE(at::equal(t->tensors.at("rng"), trainer_of(r, kSaveAt).tensors.at("rng")));
          } else {
            EXPECT_TRUE(t->tensors.empty());
          }
          again.steps(kSaveAt, kEnd);
          const auto resumed = again.params();
          for (const auto& [name, value] : from_disk) {
            EXPECT_TRUE(at::equal(resumed.at(name), value))
                << name << " differs from the disk resume";
            ok = ok && at::equal(resumed.at(name), value);
          }
          std::string worst;
          const double d = test::max_abs_diff(resumed, uninterrupted, &worst);
          EXPECT_LE(d, 1e-4) << worst;
          ok = ok && d <= 1e-4;
          // A snapshot after the restore commits at M and is restored at M.
          snaps.snapshot(trainer_of(r, kEnd));
          snaps.wait();
          // Its commit gave back the memory of the old world's ranks that this one has not.
          for (const auto& e :
               fs::directory_iterator(base + "/" + c.dirs[static_cast<size_t>(r)])) {
            const std::string name = e.path().filename().string();
            for (int q = c.m; q < c.n; ++q) {
              EXPECT_NE(name.rfind(fmt::format("rank{}.", q), 0), 0u) << name;
              EXPECT_NE(name.rfind(fmt::format("copy-of-rank{}.", q), 0), 0u) << name;
            }
          }
          Run later(comm, stage, rule);
          MemorySnapshots again_snaps(*later.opt, comm,
                                      {base + "/" + c.dirs[static_cast<size_t>(r)], c.m_per_host});
          RestoreReport second;
          ASSERT_TRUE(again_snaps.restore(&second).has_value()) << second.reason;
          EXPECT_EQ(second.number, kSaveAt);
          EXPECT_EQ(second.step, kEnd);
          EXPECT_EQ(second.saved_world, c.m);
        };
        if (comm) restart_at_m();
        test::world()->barrier();
        if (test::world()->rank() == 0) fs::remove_all(base);
      }
    }
  }
  EXPECT_TRUE(test::all_ranks(ok));
}

// Both copies of a record gone: nullopt with the reason, on every rank; a corrupt record: an
// error naming the slot on every rank, the optimizer unchanged; another model: Mismatch.
DIST_TEST(SnapshotReshard, RefusesLostCorruptAndForeignRecords) {
  const int world = test::world()->size();
  if (world < 2) GTEST_SKIP() << "needs 2 ranks or more";
  const Case c = world >= 4 ? Case{4, 2, 2, 2, -1, {"host-0", "host-0"}, 0}
                            : Case{2, 1, 1, 1, -1, {"host-0"}, 0};
  const std::string base = test::shared_dir("snapshot-reshard-refusals");
  save_at_n(c, base, 2, "adamw");
  const std::string host0 = base + "/host-0", host1 = base + "/host-1";
  auto comm = test::first_ranks(c.m);
  const int k = (kSaveAt - 1) % 2;
  auto restart = [&](bool wider = false) {
    auto run = std::make_unique<Run>(comm, 2, "adamw", wider);
    return run;
  };
  // Another model: Mismatch naming what differs.
  if (comm) {
    auto run = restart(/*wider=*/true);
    MemorySnapshots snaps(*run->opt, comm, {host0, c.m_per_host});
    test::expect_error([&] { snaps.restore(); }, ErrorKind::Mismatch, {"snapshot", "parameters"});
  }
  test::world()->barrier();
  // A flipped byte in old rank 0's record (the copy on host 1 is not asked for: the record on
  // host 0 is its own): the checksum fails on every rank, nothing restored.
  if (test::world()->rank() == 0) {
    std::fstream f(fmt::format("{}/rank0.slot{}", host0, k),
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(64 + 5);
    f.put('\x7f');
  }
  test::world()->barrier();
  if (comm) {
    auto run = restart();
    const auto before = run->params();
    MemorySnapshots snaps(*run->opt, comm, {host0, c.m_per_host});
    test::expect_error([&] { snaps.restore(); }, ErrorKind::Checkpoint,
                       {fmt::format("rank0.slot{}", k), "CRC-32C"});
    EXPECT_EQ(run->opt->last_step().step, 0);
    for (const auto& [name, value] : run->params())
      EXPECT_TRUE(at::equal(value, before.at(name))) << name;
  }
  test::world()->barrier();
  // Old rank 1's record on no host: its own host 1 (or host 0 at N = 2: rank 1's) and the copy.
  if (test::world()->rank() == 0) {
    fs::remove_all(host1);
    fs::remove(fmt::format("{}/rank1.slot{}", host0, k));
    fs::remove(fmt::format("{}/copy-of-rank1.slot{}", host0, k));
  }
  test::world()->barrier();
  if (comm) {
    auto run = restart();
    MemorySnapshots snaps(*run->opt, comm, {host0, c.m_per_host});
    RestoreReport report;
    EXPECT_FALSE(snaps.restore(&report).has_value());
    EXPECT_NE(report.reason.find(fmt::format("world of {} ranks", c.n)), std::string::npos)
        << report.reason;
    EXPECT_NE(report.reason.find("old rank 1's record"), std::string::npos) << report.reason;
    EXPECT_EQ(run->opt->last_step().step, 0);
  }
  test::world()->barrier();
  if (test::world()->rank() == 0) fs::remove_all(base);
}

// Hosts as the communicator sees them (a directory per host name, ranks_per_host counted): saved
// by 4 ranks, restored by world ranks 0 and 2. Across emulated hosts (tests/multihost: ranks 0-1
// on one host, 2-3 on the other, TCP between them) each of the two serves its host's records and
// the slices cross hosts; on one machine every record is in one directory. The continued run is
// bitwise the one resumed from a disk checkpoint of the same step.
DIST_TEST(SnapshotReshard, AcrossHosts) {
  auto world = test::world();
  if (world->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  const std::string base = test::shared_dir("snapshot-reshard-hosts");
  const SnapshotOptions here{fmt::format("{}/{}", base, name), 0};
  {
    Run run(world, 2, "adamw");
    MemorySnapshots snaps(*run.opt, world, here);
    for (int64_t s = 0; s < kSaveAt; ++s) {
      run.steps(s, s + 1);
      snaps.snapshot(trainer_of(world->rank(), s + 1));
    }
    snaps.wait();
    save_checkpoint(*run.opt, base + "/disk", trainer_of(world->rank(), kSaveAt));
    run.steps(kSaveAt, kSaveAt + 1);  // lost
  }
  world->barrier();
  auto pair = world->split(world->rank() % 2 == 0 ? 0 : -1, world->rank());
  auto restart = [&] {
    Run disk(pair, 2, "adamw");
    load_checkpoint(*disk.opt, base + "/disk");
    disk.steps(kSaveAt, kEnd);
    const auto want = disk.params();
    Run again(pair, 2, "adamw");
    MemorySnapshots snaps(*again.opt, pair, here);
    RestoreReport report;
    const auto t = snaps.restore(&report);
    ASSERT_TRUE(t.has_value()) << report.reason;
    if (pair->rank() == 0) {
      std::printf("[snapshot_reshard] %s: restored snapshot %lld of %d ranks at 2 in %.3f s\n",
                  name, static_cast<long long>(report.number), report.saved_world, report.seconds);
    }
    EXPECT_EQ(report.saved_world, 4);
    EXPECT_EQ(report.step, kSaveAt);
    again.steps(kSaveAt, kEnd);
    for (const auto& [param, value] : again.params()) {
      EXPECT_TRUE(at::equal(value, want.at(param))) << param << " differs from the disk resume";
    }
  };
  if (pair) restart();
  world->barrier();
  if (world->rank() == 0) fs::remove_all(base);
}

// Hybrid sharding (a layout sharded over groups, replicated across them) does not reshard from
// memory, saved or restored that way: nullopt with the reason on every rank, nothing changed.
DIST_TEST(SnapshotReshard, RefusesHybridSharding) {
  const int world = test::world()->size();
  if (world < 4) GTEST_SKIP() << "needs 4 ranks";
  auto hybrid = [](const CommunicatorPtr& comm, int group) {
    return std::make_unique<Run>(comm, 1, "adamw", false, group);
  };
  for (const bool saved_hybrid : {true, false}) {
    const std::string base = test::shared_dir("snapshot-reshard-hybrid");
    {
      auto comm = test::first_ranks(4);
      auto run = saved_hybrid ? hybrid(comm, 2) : std::make_unique<Run>(comm, 1, "adamw");
      MemorySnapshots snaps(*run->opt, comm, {base + "/host-0", 4});
      run->steps(0, 1);
      snaps.snapshot(trainer_of(comm->rank(), 1));
      snaps.wait();
    }
    auto comm = test::first_ranks(2);
    if (comm) {
      auto run = saved_hybrid ? std::make_unique<Run>(comm, 1, "adamw") : hybrid(comm, 1);
      MemorySnapshots snaps(*run->opt, comm, {base + "/host-0", 2});
      RestoreReport report;
      EXPECT_FALSE(snaps.restore(&report).has_value());
      EXPECT_NE(report.reason.find("world of 4 ranks"), std::string::npos) << report.reason;
      EXPECT_NE(report.reason.find("hybrid sharding"), std::string::npos) << report.reason;
      EXPECT_EQ(run->opt->last_step().step, 0);
    }
    test::world()->barrier();
    if (test::world()->rank() == 0) fs::remove_all(base);
  }
}

}  // namespace
}  // namespace shardopt
