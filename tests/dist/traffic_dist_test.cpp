// Bytes each rank sends per step, by link class, against the formulas (Ψ = padded elements, N
// ranks, L ranks on this rank's host, 4 bytes per fp32 element). Hosts are those the engine
// reports (split_by_host) when the run spans several (tests/multihost), otherwise emulated as
// blocks of 2 ranks, so one mpirun -np 4 on one machine checks the same formulas.
//   flat stages 0-2:  2Ψ·4·(N-1)/N in all, of which 2Ψ·4·(N-L)/N leave the host;
//   flat stage 3:     every collective is a reduce-scatter or all-gather of the whole layout:
//                     elements·4·(N-1)/N, the same share leaving the host;
//   hybrid (shard groups = hosts of L ranks, H hosts), every stage: only the all-reduce of the
//                     gradient shard crosses, 2·(Ψ/L)·4·(H-1)/H, 1/L of flat's 2Ψ·4·(H-1)/H;
//                     stages 0-2 move 2Ψ·4·(L-1)/L within the host.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "shardopt/optimizer.hpp"
#include "support/checkpoint_model.hpp"
#include "support/counting_communicator.hpp"
#include "support/dist_env.hpp"

namespace shardopt {
namespace {

using test::CkptNet;

// The world's hosts: the engine's own when there are several, else blocks of 2 ranks.
std::vector<int> hosts_of_world() {
  auto world = test::world();
  std::vector<int> hosts = test::CountingCommunicator::host_ids(*world);
  if (std::set<int>(hosts.begin(), hosts.end()).size() > 1) return hosts;
  for (int r = 0; r < world->size(); ++r) hosts[r] = r / 2;
  return hosts;
}

struct Counted {
  test::Traffic per_step;  // the last step's
  int64_t padded_numel = 0;
};

Counted train_counted(const ZeroOptions& base, CommunicatorPtr counting_world,
                      const test::CountingCommunicator& counter) {
  CkptNet net;
  ZeroOptions zo = base;
  zo.units = net.units;
  zo.bucket_bytes = 64;
  zo.timeout = std::chrono::seconds(60);
  DistributedOptimizer opt(net.groups(), test::ckpt_rule("adamw"), counting_world, zo);
  Counted out;
  for (int64_t s = 0; s < 3; ++s) {
    const test::Traffic before = counter.traffic();
    test::ckpt_train(opt, net, s, s + 1);
    const test::Traffic& after = counter.traffic();
    out.per_step.elements = after.elements - before.elements;
    out.per_step.intra_host_bytes = after.intra_host_bytes - before.intra_host_bytes;
    out.per_step.inter_host_bytes = after.inter_host_bytes - before.inter_host_bytes;
  }
  out.padded_numel = opt.padded_numel();
  return out;
}

TEST(Traffic, FlatShardingFormulas) {
  auto world = test::world();
  const int64_t n = world->size(), r = world->rank();
  const std::vector<int> hosts = hosts_of_world();
  int64_t local = 0;
  for (int q = 0; q < n; ++q) local += hosts[q] == hosts[r];
  auto counting = std::make_shared<test::CountingCommunicator>(world, hosts);
  bool ok = true;
  for (int stage : {0, 1, 2, 3}) {
    ZeroOptions zo;
    zo.stage = stage_from_int(stage);
    const Counted c = train_counted(zo, counting, *counting);
    const int64_t psi = c.padded_numel;
    const int64_t sent = c.per_step.sent_bytes();
    const int64_t flag = test::nonfinite_flag_elements(stage, n);
    const int64_t expected =
        (stage == 3 ? (c.per_step.elements - flag) * 4 * (n - 1) / n : 2 * psi * 4 * (n - 1) / n) +
        test::nonfinite_flag_peer_bytes(stage, n) * (n - 1);
    EXPECT_EQ(sent, expected) << "stage " << stage;
    // One rank reduces nothing at stages 0-1 (Note [Gradients where autograd left them]).
    const int64_t reduced = n == 1 && stage <= 1 ? 0 : psi;
    const int64_t gathered = n == 1 && stage == 0 ? 0 : psi;
    if (stage < 3) EXPECT_EQ(c.per_step.elements, reduced + gathered + flag) << "stage " << stage;
    EXPECT_EQ(c.per_step.inter_host_bytes, expected / std::max<int64_t>(1, n - 1) * (n - local))
        << "stage " << stage << ", " << local << " of " << n << " ranks on this host";
    ok = ok && sent == expected &&
         c.per_step.inter_host_bytes == expected / std::max<int64_t>(1, n - 1) * (n - local);
  }
  EXPECT_TRUE(test::all_ranks(ok));
}

TEST(Traffic, HybridShardingSendsOnlyTheShardAcrossHosts) {
  auto world = test::world();
  const int64_t n = world->size(), r = world->rank();
  const std::vector<int> hosts = hosts_of_world();
  // Every rank decides alike (a skip on some ranks only would hang the others).
  std::map<int, int64_t> sizes;
  for (int q = 0; q < n; ++q) ++sizes[hosts[q]];
  const int64_t local = sizes.at(hosts[r]);
  bool equal = true;
  for (const auto& [host, size] : sizes) equal = equal && size == local;
  if (!equal || sizes.size() < 2) GTEST_SKIP() << "needs several hosts of equal size";
  const int64_t h = n / local;
  auto counting = std::make_shared<test::CountingCommunicator>(world, hosts);
  bool ok = true;
  for (int stage : {0, 1, 2, 3}) {
    ZeroOptions zo;
    zo.stage = stage_from_int(stage);
    zo.shard_group_size = static_cast<int>(local);
    const Counted c = train_counted(zo, counting, *counting);
    const int64_t psi = c.padded_numel;  // padded for groups of `local`; shards divide by h
    // The non-finite flag is all-reduced within the host, then across hosts.
    const int64_t flag = test::nonfinite_flag_peer_bytes(stage, n);
    const int64_t inter = 2 * (psi / local) * 4 * (h - 1) / h + flag * (h - 1);
    EXPECT_EQ(c.per_step.inter_host_bytes, inter) << "stage " << stage;
    ok = ok && c.per_step.inter_host_bytes == inter;
    if (stage < 3) {
      const int64_t intra = 2 * psi * 4 * (local - 1) / local + flag * (local - 1);
      EXPECT_EQ(c.per_step.intra_host_bytes, intra) << "stage " << stage;
      ok = ok && c.per_step.intra_host_bytes == intra;
    }
  }
  EXPECT_TRUE(test::all_ranks(ok));
}

}  // namespace
}  // namespace shardopt
