// The thread engine (shardopt/threads.hpp) at N = 1..4 in one process: every operation against
// results computed here in the engine's order (bitwise), sub-communicators, point-to-point and the
// batched exchange, and the ways a job fails: a rank that throws, a rank that ends early, a rank
// that never arrives, ranks that disagree. dist_tests' ThreadEngineCommTest compares the same
// operations against the MPI engine.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "shardopt/error.hpp"
#include "shardopt/threads.hpp"
#include "support/expect_error.hpp"

namespace shardopt {
namespace {

// Rank r's input of `numel` elements: integer-valued, so every order of summation agrees.
at::Tensor input_of(int rank, int64_t numel, at::ScalarType dtype) {
  return (at::arange(numel, at::kDouble) * (rank + 1) - 3 * rank).to(dtype);
}

// The result of reducing every rank's input in rank order.
at::Tensor reduced(int n, int64_t numel, at::ScalarType dtype, ReduceOp op) {
  at::Tensor acc = input_of(0, numel, dtype);
  for (int r = 1; r < n; ++r) {
    const at::Tensor x = input_of(r, numel, dtype);
    acc = op == ReduceOp::Max ? at::maximum(acc, x) : op == ReduceOp::Min ? at::minimum(acc, x) : acc + x;
  }
  if (op == ReduceOp::Avg) acc = at::isFloatingType(dtype) ? acc / n : acc.div(n, "trunc");
  return acc;
}

class ThreadEngine : public ::testing::TestWithParam<int> {};

TEST_P(ThreadEngine, EveryCollectiveMatchesTheRankOrderResult) {
  const int n = GetParam();
  std::atomic<int> checks{0};
  run_ranks(n, [&](const CommunicatorPtr& comm) {
    EXPECT_EQ(comm->backend(), "threads");
    EXPECT_EQ(comm->size(), n);
    EXPECT_EQ(thread_rank(), comm->rank());
    const int r = comm->rank();
    for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kInt, at::kLong}) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
        at::Tensor t = input_of(r, 10, dtype);
        comm->all_reduce(t, op);
        EXPECT_TRUE(t.equal(reduced(n, 10, dtype, op))) << c10::toString(dtype) << " " << to_string(op);
        // reduce_scatter in place: the output is this rank's slice of the input.
        at::Tensor in = input_of(r, 3 * n, dtype);
        at::Tensor mine = in.narrow(0, 3 * r, 3);
        comm->reduce_scatter(in, mine, op);
        EXPECT_TRUE(mine.equal(reduced(n, 3 * n, dtype, op).narrow(0, 3 * r, 3)));
        ++checks;
      }
      // all_gather, in place and into another tensor.
      at::Tensor out = at::full({4 * n}, -1, dtype);
      out.narrow(0, 4 * r, 4).copy_(input_of(r, 4, dtype));
      comm->all_gather(out.narrow(0, 4 * r, 4), out);
      at::Tensor separate = at::empty({4 * n}, dtype);
      comm->all_gather(input_of(r, 4, dtype), separate);
      for (int q = 0; q < n; ++q) {
        EXPECT_TRUE(out.narrow(0, 4 * q, 4).equal(input_of(q, 4, dtype)));
        EXPECT_TRUE(separate.narrow(0, 4 * q, 4).equal(input_of(q, 4, dtype)));
      }
      for (int root = 0; root < n; ++root) {
        at::Tensor b = input_of(r, 5, dtype);
        comm->broadcast(b, root);
        EXPECT_TRUE(b.equal(input_of(root, 5, dtype)));
      }
    }
    // Several outstanding at once, waited in reverse order.
    std::vector<at::Tensor> ts;
    std::vector<WorkPtr> works;
    for (int i = 0; i < 4; ++i) {
      ts.push_back(at::full({6}, float(r + i)));
      works.push_back(comm->all_reduce(ts.back(), ReduceOp::Sum, /*async=*/true));
    }
    for (int i = 3; i >= 0; --i) {
      works[i]->wait();
      EXPECT_TRUE(ts[i].equal(at::full({6}, float(n * i + n * (n - 1) / 2))));
      EXPECT_TRUE(works[i]->is_completed());
    }
    comm->barrier();
  });
  EXPECT_EQ(checks.load(), n * 5 * 4);
  EXPECT_EQ(thread_rank(), -1);
}

TEST_P(ThreadEngine, SplitMakesGroupsOrderedByKey) {
  const int n = GetParam();
  run_ranks(n, [&](const CommunicatorPtr& comm) {
    const int r = comm->rank();
    // Even and odd ranks, ranked in reverse; the last rank of a world of 3 or more joins none.
    const bool out = n >= 3 && r == n - 1;
    EXPECT_EQ(comm->split_by_host()->size(), n);  // every thread-rank is on this host
    CommunicatorPtr sub = comm->split(out ? -1 : r % 2, -r);
    if (out) {
      EXPECT_EQ(sub, nullptr);
      return;
    }
    ASSERT_NE(sub, nullptr);
    EXPECT_EQ(sub->backend(), "threads");
    int members = 0, position = 0;
    for (int q = 0; q < n; ++q) {
      if (q % 2 != r % 2 || (n >= 3 && q == n - 1)) continue;
      ++members;
      if (q > r) ++position;  // reverse order of key -q
    }
    EXPECT_EQ(sub->size(), members);
    EXPECT_EQ(sub->rank(), position);
    at::Tensor t = at::full({1}, double(r));
    sub->all_reduce(t);
    double expected = 0;
    for (int q = r % 2; q < n; q += 2) expected += (n >= 3 && q == n - 1) ? 0 : q;
    EXPECT_EQ(t.item<double>(), expected);
  });
}

TEST_P(ThreadEngine, PointToPointInOrderAndTheBatchedExchange) {
  const int n = GetParam();
  if (n == 1) GTEST_SKIP() << "point-to-point needs two ranks";
  run_ranks(n, [&](const CommunicatorPtr& comm) {
    const int r = comm->rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
    // Three messages to the next rank, received in the order sent.
    for (int i = 0; i < 3; ++i) comm->isend(at::full({4}, float(10 * r + i)), next);
    for (int i = 0; i < 3; ++i) {
      at::Tensor got = at::empty({4});
      comm->recv(got, prev);
      EXPECT_TRUE(got.equal(at::full({4}, float(10 * prev + i))));
    }
    // Megatron's step: send forward and receive backward with each neighbour in one batch.
    at::Tensor from_prev = at::empty({2, 3}, at::kDouble), from_next = at::empty({2, 3}, at::kDouble);
    comm->batch_isend_irecv({P2pOp::send(at::full({2, 3}, double(r), at::kDouble), next),
                             P2pOp::send(at::full({2, 3}, double(-r), at::kDouble), prev),
                             P2pOp::recv(from_prev, prev), P2pOp::recv(from_next, next)})
        ->wait();
    EXPECT_TRUE(from_prev.equal(at::full({2, 3}, double(prev), at::kDouble)));
    EXPECT_TRUE(from_next.equal(at::full({2, 3}, double(-next), at::kDouble)));
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ThreadEngine, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

TEST(ThreadEngineFailure, AReceiveOfAnotherSizeIsAMismatch) {
  std::string message;
  EXPECT_THROW(run_ranks(2, [&](const CommunicatorPtr& comm) {
                 if (comm->rank() == 0) {
                   comm->send(at::ones({5}), 1);
                 } else {
                   message = test::expect_error([&] { comm->recv(at::empty({4}), 0); },
                                                ErrorKind::Mismatch, {"expected 4 x Float", "got 5 x Float"});
                   throw std::runtime_error("rank 1 saw the mismatch");
                 }
               }),
               std::runtime_error);
  EXPECT_NE(message.find("shardopt[rank 1/2]"), std::string::npos) << message;
}

// Rank 1 throws; rank 0, waiting in a collective, is ended with rank 1's message, and run_ranks
// rethrows rank 1's own exception.
TEST(ThreadEngineFailure, AnErrorOnOneRankEndsEveryRank) {
  for (int n : {2, 4}) {
    std::mutex mutex;
    std::vector<std::string> seen;
    try {
      run_ranks(n, [&](const CommunicatorPtr& comm) {
        if (comm->rank() == 1) SHARDOPT_FAIL(InvalidArgument, "the batch file is missing");
        const std::string what = test::expect_error(
            [&] { comm->all_reduce(at::ones({3})); }, ErrorKind::Communication,
            {"all_reduce([3] ", ", sum) on threads", "rank 1 failed",
             "the batch file is missing"});
        std::lock_guard<std::mutex> lock(mutex);
        seen.push_back(what);
      });
      ADD_FAILURE() << "run_ranks returned";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
      EXPECT_EQ(e.rank(), 1);
      EXPECT_NE(std::string(e.what()).find(fmt::format("shardopt[rank 1/{}] the batch file is missing", n)),
                std::string::npos) << e.what();
    }
    EXPECT_EQ(seen.size(), static_cast<size_t>(n - 1));
  }
}

TEST(ThreadEngineFailure, ARankThatEndedCannotBeWaitedFor) {
  run_ranks(3, [](const CommunicatorPtr& comm) {
    if (comm->rank() == 2) return;  // ends without joining
    test::expect_error([&] { comm->barrier(); }, ErrorKind::Communication,
                       {"barrier() on threads", "rank 2 has ended without joining it"});
    // Point-to-point between the two that remain still works.
    at::Tensor t = at::full({2}, float(comm->rank()));
    if (comm->rank() == 0) comm->send(t, 1); else comm->recv(t, 0);
    EXPECT_EQ(t[0].item<float>(), 0.0f);
  });
}

// A rank that never arrives: the others' collective ends in Error{Timeout} naming it within the
// timeout, and the process goes on.
TEST(ThreadEngineFailure, ARankThatNeverArrivesTimesOut) {
  ThreadRanksOptions options;
  options.timeout = std::chrono::milliseconds(300);
  std::atomic<bool> timed_out{false};
  const auto start = std::chrono::steady_clock::now();
  run_ranks(2, [&](const CommunicatorPtr& comm) {
    if (comm->rank() == 1) {
      while (!timed_out) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;  // stalled: never joins rank 0's collective
    }
    test::expect_error([&] { comm->all_reduce(at::ones({7}), ReduceOp::Max); },
                       ErrorKind::Timeout, {"all_reduce([7] ", ", max) on threads",
                                            "did not complete within 300 ms"});
    EXPECT_TRUE(detail::collective_timed_out());  // this rank's teardown stops waiting
    timed_out = true;
  }, options);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
  // The next job's ranks start afresh: the timeout was that rank's, not the process's.
  run_ranks(1, [](const CommunicatorPtr&) { EXPECT_FALSE(detail::collective_timed_out()); });
}

// Rank 1 issues a broadcast, then rank 0 an all-reduce as the same collective: rank 0 is told
// both calls; rank 1's wait ends with rank 0's failure.
TEST(ThreadEngineFailure, RanksThatDisagreeAreAMismatch) {
  std::atomic<bool> issued{false};
  try {
    run_ranks(2, [&](const CommunicatorPtr& comm) {
      at::Tensor t = at::ones({4});
      if (comm->rank() == 1) {
        WorkPtr work = comm->broadcast(t, 0, /*async=*/true);
        issued = true;
        test::expect_error([&] { work->wait(); }, ErrorKind::Communication, {"rank 0 failed"});
        return;
      }
      while (!issued) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      comm->all_reduce(t);
    });
    ADD_FAILURE() << "run_ranks returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Mismatch);
    for (const char* needle : {"collective calls differ", ", root 0) on rank 1",
                               "but all_reduce([4] ", ", sum) on rank 0"}) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
}

TEST(ThreadEngineFailure, BadArgumentsAreClearErrors) {
  test::expect_error([] { run_ranks(0, [](const CommunicatorPtr&) {}); },
                     ErrorKind::InvalidArgument, {"n must be at least 1, got 0"});
  test::expect_error([] { make_thread_communicators(-1); }, ErrorKind::InvalidArgument,
                     {"n must be at least 1"});
  InitOptions init;
  init.backend = "threads:2";
  test::expect_error([&] { init_from_env(init); }, ErrorKind::InvalidArgument,
                     {"'threads:2'", "shardopt::run_ranks"});
}

// Callers with threads of their own: make_thread_communicators.
TEST(ThreadEngine, CommunicatorsForThreadsOfTheCaller) {
  auto comms = make_thread_communicators(3);
  std::vector<at::Tensor> ts;
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) ts.push_back(at::full({2}, float(r)));
  for (int r = 0; r < 3; ++r) threads.emplace_back([&, r] { comms[r]->all_reduce(ts[r]); });
  for (auto& t : threads) t.join();
  for (const auto& t : ts) EXPECT_TRUE(t.equal(at::full({2}, 3.0f)));
}

}  // namespace
}  // namespace shardopt
