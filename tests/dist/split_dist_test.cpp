// Communicator::split and split_by_host on every engine: membership and order by (color, key),
// collectives inside the parts, splits of splits, no part for color < 0, the world rank kept in
// error messages; and the counting communicator's bytes per link class on a 2-host layout.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>

#include "shardopt/comm.hpp"
#include "shardopt/error.hpp"
#include "support/counting_communicator.hpp"
#include "support/dist_env.hpp"

namespace shardopt {
namespace {

using test::Traffic;

// Every rank's value of `x` in `comm`, in rank order.
std::vector<int64_t> gather(Communicator& comm, int64_t x) {
  at::Tensor all = at::empty({comm.size()}, at::kLong);
  comm.all_gather(at::full({1}, x, at::kLong), all);
  return std::vector<int64_t>(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + comm.size());
}

class SplitTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!comm()) GTEST_SKIP() << test::not_built(GetParam());  // the build decides: every rank
  }
  CommunicatorPtr comm() const { return test::communicator(GetParam()); }
};

// color = rank % 2, key = -rank: the parts hold the ranks of one parity in reverse order.
TEST_P(SplitTest, ColorsMakePartsOrderedByKey) {
  auto c = comm();
  const int r = c->rank(), n = c->size();
  CommunicatorPtr part = c->split(r % 2, -r);
  bool ok = part != nullptr;
  if (ok) {
    std::vector<int64_t> want;
    for (int q = n - 1; q >= 0; --q) {
      if (q % 2 == r % 2) want.push_back(q);
    }
    EXPECT_EQ(gather(*part, r), want);
    EXPECT_EQ(part->backend(), c->backend());
    EXPECT_EQ(part->timeout(), c->timeout());
    at::Tensor sum = at::full({5}, r, at::kFloat);
    part->all_reduce(sum, ReduceOp::Sum);
    int64_t total = 0;
    for (int64_t q : want) total += q;
    EXPECT_TRUE(sum.eq(static_cast<float>(total)).all().item<bool>());
    ok = gather(*part, r) == want && sum.eq(static_cast<float>(total)).all().item<bool>();
  }
  EXPECT_TRUE(test::all_ranks(ok));
}

// Ranks with color < 0 get no communicator; the others get one of the rest, and a split of it.
TEST_P(SplitTest, NegativeColorJoinsNoneAndSplitsNest) {
  auto c = comm();
  const int r = c->rank(), n = c->size();
  CommunicatorPtr rest = c->split(r == 0 && n > 1 ? -1 : 0, r);
  bool ok = (rest == nullptr) == (r == 0 && n > 1);
  if (rest) {
    EXPECT_EQ(rest->size(), n > 1 ? n - 1 : 1);
    CommunicatorPtr pairs = rest->split(rest->rank() / 2, rest->rank());
    const int expect = std::min(2, rest->size() - (rest->rank() / 2) * 2);
    EXPECT_EQ(pairs->size(), expect);
    at::Tensor x = at::full({3}, rest->rank(), at::kLong);
    pairs->all_reduce(x, ReduceOp::Max);
    const int64_t max = (rest->rank() / 2) * 2 + expect - 1;
    EXPECT_EQ(x[0].item<int64_t>(), max);
    ok = ok && pairs->size() == expect && x[0].item<int64_t>() == max;
  }
  EXPECT_TRUE(test::all_ranks(ok));
}

// The ranks of this rank's host: equal hostnames, which the emulated hosts make differ.
TEST_P(SplitTest, ByHostGroupsEqualHostnames) {
  auto c = comm();
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  std::vector<int64_t> same;  // world ranks whose hostname is ours
  at::Tensor mine = at::from_blob(name, {256}, at::kByte).clone();
  at::Tensor all = at::empty({256 * c->size()}, at::kByte);
  c->all_gather(mine, all);
  for (int q = 0; q < c->size(); ++q) {
    if (all.narrow(0, 256 * q, 256).equal(mine)) same.push_back(q);
  }
  CommunicatorPtr host = c->split_by_host();
  const bool ok = host && gather(*host, c->rank()) == same;
  EXPECT_TRUE(ok) << "host " << name;
  EXPECT_TRUE(test::all_ranks(ok));
}

// Messages from a sub-communicator still name the world rank.
TEST_P(SplitTest, ErrorsNameTheWorldRank) {
  auto c = comm();
  CommunicatorPtr solo = c->split(c->rank(), 0);
  std::string what;
  try {
    solo->broadcast(at::zeros({1}), 3);
  } catch (const Error& e) {
    what = e.what();
  }
  const std::string tag = fmt::format("shardopt[rank {}/{}]", test::world()->rank(),
                                      test::world()->size());
  EXPECT_NE(what.find(tag), std::string::npos) << what;
  EXPECT_NE(what.find("root must lie in [0, 1), got 3"), std::string::npos) << what;
  EXPECT_TRUE(test::all_ranks(what.find(tag) != std::string::npos));
}

INSTANTIATE_TEST_SUITE_P(Engines, SplitTest, ::testing::ValuesIn(test::backends()),
                         [](const auto& info) { return info.param; });

// Hosts of L ranks each (L = 2, the last host may hold fewer): a collective's bytes go to the
// intra- or inter-host class by the peer's host, counted also through split communicators.
TEST(CountingLinks, BytesPerLinkClassFollowTheDirectModel) {
  auto world = test::world();
  const int n = world->size(), r = world->rank(), local = 2;
  std::vector<int> host_of(n);
  for (int q = 0; q < n; ++q) host_of[q] = q / local;
  int same_host = 0;
  for (int q = 0; q < n; ++q) same_host += q != r && host_of[q] == host_of[r];
  const int other_hosts = n - 1 - same_host;
  auto counting = std::make_shared<test::CountingCommunicator>(world, host_of);
  const int64_t shard = 16;  // elements per rank
  at::Tensor full = at::ones({shard * n});
  at::Tensor part = at::empty({shard});
  counting->reduce_scatter(full, part);
  counting->all_gather(part, full);
  const int64_t per_peer = 2 * shard * 4;
  EXPECT_EQ(counting->traffic().intra_host_bytes, per_peer * same_host);
  EXPECT_EQ(counting->traffic().inter_host_bytes, per_peer * other_hosts);
  EXPECT_EQ(counting->traffic().elements, 2 * shard * n);
  // bf16 halves the bytes; an all_reduce counts as reduce-scatter + all-gather.
  const Traffic before = counting->traffic();
  counting->all_reduce(at::ones({shard * n}, at::kBFloat16));
  EXPECT_EQ(counting->traffic().sent_bytes() - before.sent_bytes(),
            2 * shard * 2 * (n - 1));
  // The split along hosts sends only intra-host bytes; across hosts only inter-host ones.
  CommunicatorPtr intra = counting->split(r / local, r);
  CommunicatorPtr inter = counting->split(r % local, r);
  const Traffic mid = counting->traffic();
  intra->all_reduce(at::ones({64}));
  EXPECT_EQ(counting->traffic().inter_host_bytes, mid.inter_host_bytes);
  inter->all_reduce(at::ones({64}));
  EXPECT_EQ(counting->traffic().intra_host_bytes - mid.intra_host_bytes,
            intra->size() > 1 ? 2 * ((64 + intra->size() - 1) / intra->size()) * 4 *
                                    (intra->size() - 1)
                              : 0);
  EXPECT_TRUE(test::all_ranks(!::testing::Test::HasFailure()));
}

}  // namespace
}  // namespace shardopt
