// make_hybrid_communicator: the shard group's view of the world (shardopt/comm.hpp). Every shard
// group size that divides the world (G = 1: pure replication, G = N: the world itself), every
// engine: the collectives' results against values computed locally, and the bytes by link class.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "shardopt/comm.hpp"
#include "shardopt/error.hpp"
#include "support/counting_communicator.hpp"
#include "support/dist_env.hpp"

namespace shardopt {
namespace {

// Rank r's input: small integers, exact in fp32 sums.
at::Tensor values(int world_rank, int64_t numel) {
  return ((at::arange(numel, at::kLong) * 5 + world_rank * 3) % 7).to(at::kFloat);
}

struct Param {
  std::string backend;
  int group;
};
void PrintTo(const Param& p, std::ostream* os) { *os << p.backend << ", group " << p.group; }

class HybridComm : public ::testing::TestWithParam<Param> {};

TEST_P(HybridComm, CollectivesSpanTheWorldGathersStayInTheGroup) {
  auto world = test::communicator(GetParam().backend);
  if (!world) GTEST_SKIP() << test::not_built(GetParam().backend);  // the build decides: every rank
  const int n = world->size(), g = GetParam().group, r = world->rank();
  if (n % g != 0) GTEST_SKIP() << "shard group " << g << " does not divide " << n << " ranks";
  auto hybrid = make_hybrid_communicator(world, g);
  const int replicas = n / g;
  EXPECT_EQ(hybrid->size(), g);
  EXPECT_EQ(hybrid->rank(), r % g);
  bool ok = hybrid->size() == g && hybrid->rank() == r % g;
  const int64_t shard = 6;

  // Sum: the world sum divided by the replicas; Max over the world.
  at::Tensor world_sum = at::zeros({shard * g}), world_max = at::full({shard * g}, -1.0f);
  for (int q = 0; q < n; ++q) {
    world_sum += values(q, shard * g);
    world_max = at::maximum(world_max, values(q, shard * g));
  }
  at::Tensor mine = values(r, shard * g), out = at::empty({shard});
  hybrid->reduce_scatter(mine, out, ReduceOp::Sum);
  at::Tensor want = (world_sum / replicas).narrow(0, (r % g) * shard, shard);
  EXPECT_TRUE(at::allclose(out, want)) << out << want;
  ok = ok && at::allclose(out, want);
  hybrid->reduce_scatter(mine, out, ReduceOp::Max);
  EXPECT_TRUE(out.equal(world_max.narrow(0, (r % g) * shard, shard)));
  ok = ok && out.equal(world_max.narrow(0, (r % g) * shard, shard));

  // all_reduce, divisible and not: Avg is the world mean.
  for (int64_t numel : {shard * g, shard * g + 1}) {
    at::Tensor t = values(r, numel), mean = at::zeros({numel});
    for (int q = 0; q < n; ++q) mean += values(q, numel);
    mean /= n;
    hybrid->all_reduce(t, ReduceOp::Avg);
    EXPECT_TRUE(at::allclose(t, mean)) << "numel " << numel;
    ok = ok && at::allclose(t, mean);
  }

  // all_gather within the group; broadcast from world rank 1 % g reaches everyone.
  at::Tensor gathered = at::empty({shard * g});
  hybrid->all_gather(at::full({shard}, static_cast<float>(r)), gathered);
  for (int j = 0; j < g; ++j) {
    const int from = (r / g) * g + j;  // my group's j-th rank
    ok = ok && gathered.narrow(0, j * shard, shard).eq(from).all().item<bool>();
  }
  at::Tensor b = at::full({3}, r == 1 % g ? 42.0f : -1.0f);
  hybrid->broadcast(b, 1 % g);
  ok = ok && b.eq(42).all().item<bool>();
  EXPECT_TRUE(ok) << "backend " << hybrid->backend();
  EXPECT_TRUE(test::all_ranks(ok));
}

std::vector<Param> params() {
  std::vector<Param> out;
  for (const auto& b : test::backends()) {
    for (int g : {1, 2, 4}) out.push_back({b, g});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Engines, HybridComm, ::testing::ValuesIn(params()),
                         [](const auto& info) {
                           return info.param.backend + "_group" +
                                  std::to_string(info.param.group);
                         });

TEST(HybridComm, BadGroupSizesAreNamed) {
  auto world = test::world();
  std::string what;
  try {
    make_hybrid_communicator(world, world->size() + 1);
  } catch (const Error& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("shard_group_size must divide the world size"), std::string::npos) << what;
}

// Bytes per link class with shard groups = hosts (blocks of 2 ranks here): the reduce-scatter
// sends only intra-host bytes, the shard's all-reduce only inter-host ones:
// 2 * (S) * (H - 1) / H per rank for a shard of S elements.
TEST(HybridComm, OnlyTheShardCrossesHosts) {
  auto world = test::world();
  const int n = world->size(), r = world->rank(), l = 2;
  if (n % l != 0 || n == l) GTEST_SKIP() << "needs several hosts of 2 ranks";
  std::vector<int> hosts(n);
  for (int q = 0; q < n; ++q) hosts[q] = q / l;
  auto counting = std::make_shared<test::CountingCommunicator>(world, hosts);
  auto hybrid = make_hybrid_communicator(counting, l);
  const test::Traffic before = counting->traffic();
  const int64_t shard = 64, h = n / l;
  at::Tensor in = values(r, shard * l), out = at::empty({shard});
  hybrid->reduce_scatter(in, out, ReduceOp::Sum);
  const int64_t intra = counting->traffic().intra_host_bytes - before.intra_host_bytes;
  const int64_t inter = counting->traffic().inter_host_bytes - before.inter_host_bytes;
  EXPECT_EQ(intra, shard * 4 * (l - 1));
  EXPECT_EQ(inter, 2 * (shard / h) * 4 * (h - 1));
  EXPECT_TRUE(test::all_ranks(intra == shard * 4 * (l - 1) && inter == 2 * (shard / h) * 4 * (h - 1)));
}

}  // namespace
}  // namespace shardopt
