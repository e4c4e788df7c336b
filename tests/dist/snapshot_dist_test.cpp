// In-memory snapshots (shardopt/snapshot.hpp, Note [Snapshots in memory]) at N = 1..4 ranks over
// two emulated hosts (a directory each; ranks_per_host = N/2), stages 0-3: a restarted optimizer
// that restores the newest committed snapshot continues the uninterrupted run bitwise, also when
// one host's memory is gone (the buddy sends the copies); a torn or corrupt slot, a snapshot of
// another model and one of another world size whose records are gone are refused by name on every
// rank (restores at another world size: snapshot_reshard_dist_test.cpp).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "shardopt/estimate.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/snapshot.hpp"
#include "support/dist_env.hpp"
#include "support/expect_error.hpp"
#include "support/tiny_net.hpp"

namespace shardopt {
namespace {

namespace fs = std::filesystem;

struct Run {
  test::TinyNet net;
  std::unique_ptr<DistributedOptimizer> opt;
  explicit Run(int stage, bool wider = false) : net(wider) {
    ZeroOptions zo;
    zo.stage = stage_from_int(stage);
    zo.units = net.units;
    zo.timeout = std::chrono::seconds(60);
    opt = std::make_unique<DistributedOptimizer>(net.groups(true), test::make_rule("adamw"),
                                                 test::world(), zo);
  }
  void step(int64_t s) {
    const int64_t rows = test::kBatch / test::world()->size();
    const int64_t r0 = test::world()->rank() * rows;
    auto [x, y] = test::batch(s, 0);
    opt->zero_grad();
    opt->backward(net.loss(x.narrow(0, r0, rows), y.narrow(0, r0, rows)));
    opt->step();
  }
  std::map<std::string, at::Tensor> params() {
    opt->gather_full_parameters();  // stage 3: units hold no storage between steps
    std::map<std::string, at::Tensor> out;
    for (auto& [name, t] : net.named) out[name] = t.detach().clone();
    return out;
  }
};

// Two emulated hosts when there are two ranks or more: a directory each.
SnapshotOptions options(const std::string& base) {
  const int n = test::world()->size();
  const int per_host = n >= 2 ? n / 2 : 1;
  return {fmt::format("{}/host-{}", base, test::world()->rank() / per_host), per_host};
}

void expect_bitwise(const std::map<std::string, at::Tensor>& a,
                    const std::map<std::string, at::Tensor>& b) {
  for (const auto& [name, t] : a) EXPECT_TRUE(at::equal(t, b.at(name))) << name;
}

TrainerState trainer_at(int64_t step) {
  at::Tensor rng = at::arange(5, at::kByte) + static_cast<uint8_t>(step);
  return {fmt::format(R"({{"step": {}}})", step), {{"rng", rng}}};
}

DIST_TEST(Snapshots, RestartContinuesBitwise) {
  const int n = test::world()->size();
  for (int stage = 0; stage <= 3; ++stage) {
    const std::string base = test::shared_dir(fmt::format("snapshots_stage{}", stage));
    std::map<std::string, at::Tensor> uninterrupted;
    {
      Run run(stage);
      MemorySnapshots snaps(*run.opt, test::world(), options(base));
      EXPECT_EQ(snaps.buddy(), n >= 2 ? (test::world()->rank() + n / 2) % n : -1);
      RestoreReport none;
      EXPECT_FALSE(snaps.restore(&none).has_value());
      EXPECT_NE(none.reason.find("no snapshot"), std::string::npos) << none.reason;
      for (int64_t s = 0; s < 3; ++s) {
        run.step(s);
        snaps.snapshot(trainer_at(s + 1));  // K = 1; the next joins it
      }
      snaps.wait();
      EXPECT_GT(snaps.host_bytes(), 0);
      run.step(3);
      run.step(4);  // lost with the process
      uninterrupted = run.params();
    }
    auto restart = [&](int expect_from_buddy) {
      Run again(stage);
      MemorySnapshots snaps(*again.opt, test::world(), options(base));
      RestoreReport report;
      const auto t = snaps.restore(&report);
      ASSERT_TRUE(t.has_value()) << report.reason;
      EXPECT_EQ(report.number, 2);
      EXPECT_EQ(report.step, 3);
      EXPECT_EQ(report.from_buddy, expect_from_buddy);
      EXPECT_EQ(t->json, R"({"step": 3})");
      EXPECT_TRUE(at::equal(t->tensors.at("rng"), trainer_at(3).tensors.at("rng")));
      again.step(3);
      again.step(4);
      expect_bitwise(again.params(), uninterrupted);
    };
    restart(0);
    // Host 0 replaced: its memory is gone; the buddies on host 1 send rank 0..n/2-1's records.
    if (n >= 2) {
      if (test::world()->rank() == 0) fs::remove_all(base + "/host-0");
      test::world()->barrier();
      restart(n / 2);
    }
    if (test::world()->rank() == 0) fs::remove_all(base);
  }
}

// Hosts as the communicator sees them (ranks_per_host counted by split_by_host), a directory per
// host name: on one machine every rank is on one host and there is no buddy; across emulated hosts
// (tests/multihost/emulated_hosts.sh: a network namespace and host name each, TCP between them)
// each rank's buddy is on the other host, and a restart after one host's memory is removed gets
// that host's records from the buddies.
DIST_TEST(Snapshots, AcrossHosts) {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  const std::string base = test::shared_dir("snapshots_hosts");
  const SnapshotOptions here{fmt::format("{}/{}", base, name), 0};
  std::map<std::string, at::Tensor> uninterrupted;
  int buddy = -1;
  {
    Run run(1);
    MemorySnapshots snaps(*run.opt, test::world(), here);
    buddy = snaps.buddy();
    run.step(0);
    snaps.snapshot(trainer_at(1));
    snaps.wait();
    run.step(1);
    uninterrupted = run.params();
  }
  // The buddy's host name is another one, or there is no buddy because there is one host.
  at::Tensor mine = at::zeros({256}, at::kByte), all = at::zeros({256 * test::world()->size()}, at::kByte);
  std::memcpy(mine.data_ptr(), name, 256);
  test::world()->all_gather(mine, all);
  auto host_of = [&](int rank) { return std::string(reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + 256 * rank); };
  bool one_host = true;
  for (int q = 0; q < test::world()->size(); ++q) one_host = one_host && host_of(q) == host_of(0);
  if (test::world()->rank() == 0) {
    std::printf("[snapshots] %s; rank 0's buddy: %d\n", one_host ? "one host" : "several hosts", buddy);
  }
  if (one_host) {
    EXPECT_EQ(buddy, -1);
  } else {
    EXPECT_GE(buddy, 0);
    EXPECT_NE(host_of(buddy), std::string(name));
  }
  if (!one_host && test::world()->rank() == 0) fs::remove_all(here.dir);  // host of rank 0 replaced
  test::world()->barrier();
  Run again(1);
  MemorySnapshots snaps(*again.opt, test::world(), here);
  RestoreReport report;
  ASSERT_TRUE(snaps.restore(&report).has_value()) << report.reason;
  EXPECT_EQ(report.step, 1);
  if (!one_host) EXPECT_GT(report.from_buddy, 0);
  again.step(1);
  expect_bitwise(again.params(), uninterrupted);
  test::world()->barrier();
  if (test::world()->rank() == 0) fs::remove_all(base);
}

// The estimator states the slots' host memory (Estimate::snapshot_slots): what host_bytes() and the
// optimizer's memory() report, at every stage, with and without a buddy; remove() gives it back.
DIST_TEST(Snapshots, EstimateCountsTheSlots) {
  const int n = test::world()->size();
  for (int stage = 0; stage <= 3; ++stage) {
    const std::string base = test::shared_dir(fmt::format("snapshots_estimate{}", stage));
    Run run(stage);
    MemorySnapshots snaps(*run.opt, test::world(), options(base));
    EXPECT_EQ(snaps.host_bytes(), 0);
    EXPECT_EQ(run.opt->memory().snapshot_host_bytes, 0);
    run.step(0);
    snaps.snapshot(trainer_at(1));
    run.step(1);
    snaps.snapshot(trainer_at(2));  // both slots mapped
    snaps.wait();
    estimate::Options o;
    o.params = run.opt->padded_numel();
    o.world = n;
    o.stage = stage;
    o.params_on_host = true;
    o.memory_snapshots = true;
    o.snapshot_buddy = n >= 2;
    const estimate::Estimate e = estimate::model_states(o);
    EXPECT_EQ(snaps.host_bytes(), e.snapshot_slots) << "stage " << stage;
    EXPECT_EQ(run.opt->memory().snapshot_host_bytes, e.snapshot_slots) << "stage " << stage;
    const MemoryReport m = run.opt->memory();  // tmpfs, not the process: not in total()
    EXPECT_EQ(m.total(), m.param_bytes + m.grad_bytes + m.optimizer_state_bytes + m.buffer_bytes);
    o.memory_snapshots = false;
    EXPECT_EQ(e.total() - estimate::model_states(o).total(), e.snapshot_slots);
    // A finished job gives the memory back: no slot, no marker, no directory left.
    snaps.remove();
    EXPECT_EQ(snaps.host_bytes(), 0);
    EXPECT_EQ(run.opt->memory().snapshot_host_bytes, 0);
    EXPECT_FALSE(fs::exists(options(base).dir));
    test::world()->barrier();  // before the next MemorySnapshots makes it again
    RestoreReport none;
    EXPECT_FALSE(MemorySnapshots(*run.opt, test::world(), options(base)).restore(&none).has_value());
    EXPECT_NE(none.reason.find("no snapshot"), std::string::npos) << none.reason;
    if (test::world()->rank() == 0) fs::remove_all(base);
  }
}

DIST_TEST(Snapshots, RefusesCorruptForeignAndResizedSnapshots) {
  const int n = test::world()->size();
  const std::string base = test::shared_dir("snapshots_refusals");
  {
    Run run(2);
    MemorySnapshots snaps(*run.opt, test::world(), options(base));
    run.step(0);
    snaps.snapshot(trainer_at(1));
    snaps.wait();
  }
  const std::string host0 = base + "/host-0";
  // Another model (a wider layer): Mismatch naming what differs, on every rank.
  {
    Run other(2, /*wider=*/true);
    MemorySnapshots snaps(*other.opt, test::world(), options(base));
    test::expect_error([&] { snaps.restore(); }, ErrorKind::Mismatch, {"snapshot", "clear"});
  }
  // A flipped byte in rank 0's record: the checksum fails on every rank.
  if (test::world()->rank() == 0) {
    std::fstream f(host0 + "/rank0.slot0", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(64 + 5);
    f.put('\x7f');
  }
  test::world()->barrier();
  {
    Run run(2);
    MemorySnapshots snaps(*run.opt, test::world(), options(base));
    test::expect_error([&] { snaps.restore(); }, ErrorKind::Checkpoint, {"rank0.slot0", "CRC-32C"});
  }
  // A commit of another world size whose records are on no host: not restored, with the reason
  // (the caller's disk checkpoint then reshards; Note [Snapshots at another world size]).
  if (test::world()->rank() == 0) std::ofstream(host0 + "/rank0.commit") << "7 " << n + 1 << " 1\n";
  test::world()->barrier();
  {
    Run run(2);
    MemorySnapshots snaps(*run.opt, test::world(), options(base));
    RestoreReport report;
    EXPECT_FALSE(snaps.restore(&report).has_value());
    EXPECT_NE(report.reason.find(fmt::format("world of {} ranks", n + 1)), std::string::npos)
        << report.reason;
  }
  test::expect_error(
      [&] {
        Run run(0);
        MemorySnapshots bad(*run.opt, test::world(), {"", 0});
      },
      ErrorKind::InvalidArgument, {"SnapshotOptions::dir"});
  if (test::world()->rank() == 0) fs::remove_all(base);
}

}  // namespace
}  // namespace shardopt
