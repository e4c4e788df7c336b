// Point-to-point messages (Communicator::send/recv/isend/irecv/batch_isend_irecv) on every engine:
// tensors of every dtype and several sizes arrive bitwise, in order; a message of another dtype or
// size, a peer out of range and a peer that never sends are named errors, never hangs.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "shardopt/comm.hpp"
#include "shardopt/error.hpp"
#include "support/dist_env.hpp"
#include "support/expect_error.hpp"

namespace shardopt {
namespace {

const std::vector<at::ScalarType> kDtypes{at::kFloat, at::kDouble, at::kHalf, at::kBFloat16,
                                          at::kInt,   at::kLong,   at::kByte};

// Bytes that depend on the sender, the dtype and the size (NaN patterns included: compared as
// bytes, never as numbers).
at::Tensor payload(int from, at::ScalarType dtype, int64_t numel, int salt = 0) {
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  at::Tensor b = (at::arange(bytes, at::kLong) * (2 * from + 3) + static_cast<int>(dtype) * 17 +
                  salt * 101) % 251;
  return b.to(at::kByte).view(dtype);
}

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  return a.numel() == b.numel() && a.scalar_type() == b.scalar_type() &&
         a.view(at::kByte).equal(b.view(at::kByte));
}

class P2pTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!test::communicator(GetParam())) GTEST_SKIP() << test::not_built(GetParam());
    if (test::world()->size() == 1) GTEST_SKIP() << "needs a second rank";
  }
  CommunicatorPtr comm() const { return test::communicator(GetParam()); }
};

// A ring: every rank sends to the next and receives from the previous, in one batch.
TEST_P(P2pTest, RingEveryDtypeAndSizeArrivesBitwise) {
  auto c = comm();
  const int n = c->size(), r = c->rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  bool ok = true;
  for (auto dtype : kDtypes) {
    for (int64_t numel : {1, 7, 1000, 300000}) {
      at::Tensor out = payload(r, dtype, numel);
      at::Tensor in = at::zeros({numel}, dtype);
      c->batch_isend_irecv({P2pOp::send(out, next), P2pOp::recv(in, prev)})->wait();
      const bool good = same_bytes(in, payload(prev, dtype, numel));
      EXPECT_TRUE(good) << c10::toString(dtype) << " x " << numel << " from rank " << prev;
      ok = ok && good;
    }
  }
  EXPECT_TRUE(test::all_ranks(ok));
}

// Blocking send/recv between pairs (even ranks send first), then many non-blocking messages in
// flight at once, waited for in reverse order: they still match in the order issued.
TEST_P(P2pTest, BlockingAndManyOutstandingInOrder) {
  auto c = comm();
  const int r = c->rank();
  const int peer = r % 2 == 0 ? r + 1 : r - 1;
  bool ok = true;
  if (peer < c->size()) {
    at::Tensor got = at::empty({64}, at::kFloat);
    if (r % 2 == 0) {
      c->send(payload(r, at::kFloat, 64), peer);
      c->recv(got, peer);
    } else {
      c->recv(got, peer);
      c->send(payload(r, at::kFloat, 64), peer);
    }
    ok = same_bytes(got, payload(peer, at::kFloat, 64));

    constexpr int kMessages = 12;
    std::vector<at::Tensor> received;
    std::vector<WorkPtr> works;
    for (int i = 0; i < kMessages; ++i) {
      const auto dtype = kDtypes[i % kDtypes.size()];
      const int64_t numel = 1 + 37 * i;
      received.push_back(at::zeros({numel}, dtype));
      works.push_back(c->isend(payload(r, dtype, numel, i), peer));
      works.push_back(c->irecv(received.back(), peer));
    }
    for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
    for (int i = 0; i < kMessages; ++i) {
      const auto dtype = kDtypes[i % kDtypes.size()];
      const bool good = same_bytes(received[i], payload(peer, dtype, 1 + 37 * i, i));
      EXPECT_TRUE(good) << "message " << i;
      ok = ok && good;
    }
  }
  EXPECT_TRUE(test::all_ranks(ok));
}

// Rank 0 sends, rank 1 expects something else: rank 1 gets a Mismatch naming both, rank 0's send
// completes, and the next, matching message still arrives (the channel stays in step).
TEST_P(P2pTest, MismatchIsANamedErrorAndTheChannelRecovers) {
  auto c = comm();
  const int r = c->rank();
  struct Case {
    at::ScalarType sent_dtype;
    int64_t sent;
    at::ScalarType want_dtype;
    int64_t want;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases{
      {at::kFloat, 8, at::kInt, 8, {"expected 8 x Int", "Float"}},
      {at::kFloat, 8, at::kFloat, 4, {"expected 4 x Float", "from rank 0"}},
      {at::kFloat, 4, at::kFloat, 8, {"expected 8 x Float", "got 4 x Float"}},
  };
  bool ok = true;
  for (const auto& k : cases) {
    if (r == 0) {
      c->send(payload(0, k.sent_dtype, k.sent), 1);
      c->send(payload(0, at::kLong, 5), 1);
    } else if (r == 1) {
      at::Tensor wrong = at::zeros({k.want}, k.want_dtype);
      const std::string what = test::expect_error([&] { c->recv(wrong, 0); }, ErrorKind::Mismatch,
                                                  k.needles);
      ok = ok && !what.empty();
      at::Tensor next = at::zeros({5}, at::kLong);
      c->recv(next, 0);
      ok = ok && same_bytes(next, payload(0, at::kLong, 5));
    }
  }
  EXPECT_TRUE(test::all_ranks(ok));
}

TEST_P(P2pTest, PeerOutOfRangeIsANamedError) {
  auto c = comm();
  const int n = c->size();
  at::Tensor t = at::zeros({4});
  test::expect_error([&] { c->send(t, n); }, ErrorKind::InvalidArgument,
                     {"comm.send", fmt::format("[0, {})", n), fmt::format("got {}", n)});
  test::expect_error([&] { c->irecv(t, -1); }, ErrorKind::InvalidArgument,
                     {"comm.recv", "got -1"});
  test::expect_error([&] { c->isend(t, c->rank()); }, ErrorKind::InvalidArgument,
                     {"this rank"});
  test::expect_error([&] { c->send(at::zeros({4, 4}).t(), (c->rank() + 1) % n); },
                     ErrorKind::InvalidArgument, {"contiguous"});
  EXPECT_TRUE(test::all_ranks(true));
}

INSTANTIATE_TEST_SUITE_P(Engines, P2pTest, ::testing::ValuesIn(test::backends()),
                         [](const auto& info) { return info.param; });

// A receive from a rank that does not send times out with the message named; once the peer
// sends, waiting again completes it (MPI cannot cancel; Gloo's header is still awaited).
void receive_times_out_then_completes(const CommunicatorPtr& c) {
  auto world = test::world();
  const int r = world->rank();
  bool ok = true;
  if (r == 1) {
    at::Tensor got = at::zeros({16});
    auto work = c->irecv(got, 0);
    test::expect_error([&] { work->wait(std::chrono::milliseconds(300)); }, ErrorKind::Timeout,
                       {"recv([16] Float cpu from rank 0)", "did not complete within 300 ms"});
    world->barrier();  // tells rank 0 we have timed out
    work->wait();
    ok = same_bytes(got, payload(0, at::kFloat, 16));
  } else {
    world->barrier();
    if (r == 0) c->send(payload(0, at::kFloat, 16), 1);
  }
  EXPECT_TRUE(test::all_ranks(ok));
}

TEST(P2pTimeout, MpiReceiveTimesOutThenCompletes) {
  if (test::world()->size() == 1) GTEST_SKIP() << "needs a second rank";
  InitOptions init;
  init.backend = "mpi";
  receive_times_out_then_completes(init_from_env(init));
}

TEST(P2pTimeout, GlooReceiveTimesOutThenCompletes) {
  if (test::world()->size() == 1) GTEST_SKIP() << "needs a second rank";
  auto gloo = test::fresh_gloo(std::chrono::seconds(60));
  if (!gloo) GTEST_SKIP() << test::not_built("gloo");
  receive_times_out_then_completes(gloo);
}

}  // namespace
}  // namespace shardopt
