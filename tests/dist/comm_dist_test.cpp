// Every engine's collectives against values each rank computes on its own, for every dtype and op,
// in place and out of place, sync and with several async operations outstanding.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "comm/polite_waits.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/error.hpp"
#include "shardopt/threads.hpp"
#include "support/dist_env.hpp"
#include "support/expect_error.hpp"

namespace shardopt {
namespace {

const std::vector<at::ScalarType> kDtypes{at::kFloat, at::kDouble, at::kHalf,
                                          at::kBFloat16, at::kInt, at::kLong};
const std::vector<ReduceOp> kOps{ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min};

// Small integers: exact in every dtype, sums included.
at::Tensor values(int rank, int64_t numel) {
  at::Tensor i = at::arange(numel, at::kLong);
  return ((i * 3 + rank * 7) % 11 - 3).to(at::kDouble);
}

// What `op` over all ranks gives, computed locally in float64.
at::Tensor expected_reduction(int world, int64_t numel, ReduceOp op, at::ScalarType dtype) {
  at::Tensor acc = values(0, numel);
  for (int r = 1; r < world; ++r) {
    at::Tensor v = values(r, numel);
    if (op == ReduceOp::Max) acc = at::maximum(acc, v);
    else if (op == ReduceOp::Min) acc = at::minimum(acc, v);
    else acc = acc + v;
  }
  if (op == ReduceOp::Avg) {
    acc = at::isIntegralType(dtype, false) ? at::trunc(acc / world) : acc / world;
  }
  return acc;
}

double tolerance(at::ScalarType dtype) {
  if (dtype == at::kHalf || dtype == at::kBFloat16) return 5e-2;
  return at::isIntegralType(dtype, false) ? 0.0 : 1e-6;
}

double max_diff(const at::Tensor& got, const at::Tensor& want) {
  return (got.to(at::kDouble) - want).abs().max().item<double>();
}

class CommTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {  // same outcome on every rank: the build decides
    if (!test::communicator(GetParam())) GTEST_SKIP() << test::not_built(GetParam());
  }
  CommunicatorPtr comm() const { return test::communicator(GetParam()); }
};

TEST_P(CommTest, AllReduceEveryDtypeAndOp) {
  auto c = comm();
  for (auto dtype : kDtypes) {
    for (auto op : kOps) {
      for (int64_t numel : {1, 7, 1000}) {  // 7: not divisible by most world sizes
        at::Tensor t = values(c->rank(), numel).to(dtype);
        c->all_reduce(t, op);
        EXPECT_LE(max_diff(t, expected_reduction(c->size(), numel, op, dtype)), tolerance(dtype))
            << c10::toString(dtype) << " " << to_string(op) << " numel " << numel;
      }
    }
  }
}

TEST_P(CommTest, ReduceScatterEveryDtypeAndOp) {
  auto c = comm();
  const int64_t shard = 37;
  for (auto dtype : kDtypes) {
    for (auto op : kOps) {
      at::Tensor input = values(c->rank(), shard * c->size()).to(dtype);
      at::Tensor want =
          expected_reduction(c->size(), shard * c->size(), op, dtype).narrow(0, c->rank() * shard, shard);
      at::Tensor out = at::empty({shard}, dtype);
      at::Tensor before = input.clone();
      c->reduce_scatter(input, out, op);
      EXPECT_LE(max_diff(out, want), tolerance(dtype)) << c10::toString(dtype) << " " << to_string(op);
      EXPECT_TRUE(input.equal(before)) << "reduce_scatter modified its input";
      // In place: the output is this rank's slice of the input.
      at::Tensor own = input.narrow(0, c->rank() * shard, shard);
      c->reduce_scatter(input, own, op);
      EXPECT_LE(max_diff(own, want), tolerance(dtype)) << "in place " << c10::toString(dtype);
    }
  }
}

TEST_P(CommTest, AllGatherEveryDtype) {
  auto c = comm();
  const int64_t shard = 29;
  for (auto dtype : kDtypes) {
    at::Tensor want = at::empty({shard * c->size()}, at::kDouble);
    for (int r = 0; r < c->size(); ++r) want.narrow(0, r * shard, shard).copy_(values(r, shard));
    at::Tensor out = at::zeros({shard * c->size()}, dtype);
    c->all_gather(values(c->rank(), shard).to(dtype), out);
    EXPECT_EQ(max_diff(out, want), 0.0) << c10::toString(dtype);
    at::Tensor in_place = at::zeros({shard * c->size()}, dtype);
    in_place.narrow(0, c->rank() * shard, shard).copy_(values(c->rank(), shard));
    c->all_gather(in_place.narrow(0, c->rank() * shard, shard), in_place);
    EXPECT_EQ(max_diff(in_place, want), 0.0) << "in place " << c10::toString(dtype);
  }
}

TEST_P(CommTest, BroadcastFromEveryRoot) {
  auto c = comm();
  for (auto dtype : kDtypes) {
    for (int root = 0; root < c->size(); ++root) {
      at::Tensor t = values(c->rank(), 100).to(dtype);
      c->broadcast(t, root);
      EXPECT_EQ(max_diff(t, values(root, 100)), 0.0) << c10::toString(dtype) << " root " << root;
    }
  }
}

TEST_P(CommTest, SeveralAsyncOperationsOutstanding) {
  auto c = comm();
  const int64_t shard = 1 << 14;
  std::vector<at::Tensor> sums, gathered, scattered;
  std::vector<WorkPtr> works;
  for (int k = 0; k < 4; ++k) {
    sums.push_back(values(c->rank() + k, 1000).to(at::kFloat));
    works.push_back(c->all_reduce(sums.back(), ReduceOp::Sum, /*async=*/true));
    gathered.push_back(at::empty({shard * c->size()}, at::kFloat));
    works.push_back(c->all_gather(at::full({shard}, float(c->rank() + k)), gathered.back(), true));
    scattered.push_back(at::empty({shard}, at::kFloat));
    works.push_back(c->reduce_scatter(at::full({shard * c->size()}, float(k)), scattered.back(),
                                      ReduceOp::Avg, true));
  }
  for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();  // reverse order
  for (int k = 0; k < 4; ++k) {
    at::Tensor want = values(k, 1000);
    for (int r = 1; r < c->size(); ++r) want = want + values(r + k, 1000);
    EXPECT_EQ(max_diff(sums[k], want), 0.0) << "all_reduce #" << k;
    for (int r = 0; r < c->size(); ++r) {
      EXPECT_TRUE(gathered[k].narrow(0, r * shard, shard).eq(float(r + k)).all().item<bool>());
    }
    EXPECT_TRUE(scattered[k].eq(float(k)).all().item<bool>()) << "reduce_scatter avg #" << k;
  }
}

// Wrong arguments are caught before anything is sent, so every rank throws and nobody hangs.
TEST_P(CommTest, BadArgumentsAreClearErrors) {
  auto c = comm();
  const int n = c->size();
  auto expect_error = [](auto&& call, const std::string& needle) {
    test::expect_error(call, ErrorKind::InvalidArgument, {needle});
  };
  expect_error([&] { c->reduce_scatter(at::zeros({n * 4 + 1}), at::zeros({4})); },
               "input must hold world size x output elements");
  expect_error([&] { c->all_gather(at::zeros({4}), at::zeros({n * 4 + 2})); },
               "output must hold world size x input elements");
  expect_error([&] { c->all_reduce(at::zeros({4, 4}).t()); }, "must be contiguous");
  expect_error([&] { c->all_gather(at::zeros({4}), at::zeros({n * 4}, at::kDouble)); },
               "dtypes differ");
  expect_error([&] { c->broadcast(at::zeros({4}), n); }, "root must lie in");
  expect_error([&] { c->all_reduce(at::zeros({4}, at::kBool)); }, "unsupported dtype");
  EXPECT_TRUE(test::all_ranks(true));  // everyone is still in step
}

INSTANTIATE_TEST_SUITE_P(Engines, CommTest, ::testing::ValuesIn(test::backends()),
                         [](const auto& info) { return info.param; });

// A rank that never makes the call: the ranks that wait get a Timeout naming the operation.
TEST(CommTimeout, GlooMissingRankTimesOut) {
  auto world = test::world();
  if (world->size() == 1) GTEST_SKIP() << "needs a second rank";
  auto gloo = test::fresh_gloo(std::chrono::milliseconds(1500));
  if (!gloo) GTEST_SKIP() << test::not_built("gloo");
  bool timed_out = world->rank() == 0;  // rank 0 plays the dead rank
  if (world->rank() != 0) {
    try {
      gloo->all_reduce(at::ones({16}), ReduceOp::Sum, true)->wait(std::chrono::milliseconds(1500));
    } catch (const Error& e) {
      timed_out = e.kind() == ErrorKind::Timeout &&
                  std::string(e.what()).find("all_reduce") != std::string::npos;
      EXPECT_TRUE(timed_out) << e.what();
    }
  }
  EXPECT_TRUE(test::all_ranks(timed_out));
}

// MPI cannot cancel, but the waiting ranks still get the error; the late rank then completes the
// call (signalled over a second communicator), so the job ends cleanly.
void expect_missing_rank_times_out_then_completes(const CommunicatorPtr& world) {
  InitOptions init;
  init.backend = "mpi";
  auto late = init_from_env(init);  // a second duplicate of MPI_COMM_WORLD
  at::Tensor t = at::ones({16});
  bool ok = true;
  if (world->rank() != 0) {
    auto work = late->all_reduce(t, ReduceOp::Sum, true);
    try {
      work->wait(std::chrono::milliseconds(300));
      ok = false;
    } catch (const Error& e) {
      ok = e.kind() == ErrorKind::Timeout &&
           std::string(e.what()).find("all_reduce") != std::string::npos;
    }
    world->barrier();  // tells rank 0 we have timed out
    work->wait();
  } else {
    world->barrier();
    late->all_reduce(t, ReduceOp::Sum);
  }
  ok = ok && t.eq(float(world->size())).all().item<bool>();
  EXPECT_TRUE(test::all_ranks(ok));
}

TEST(CommTimeout, MpiMissingRankTimesOutThenCompletes) {
  auto world = test::world();
  if (world->size() == 1) GTEST_SKIP() << "needs a second rank";
  expect_missing_rank_times_out_then_completes(world);
}

// The thread engine against the MPI engine: one fixed sequence of every operation, run by this
// process's MPI rank on MPI and by the thread-rank of the same number on N thread-ranks in this
// process; the two results must agree: bitwise for integers and for float sums over two ranks
// (any order is the same order), within 1e-6 relative for float sums over 3-4 ranks (MPI's
// reduction order is its own).
std::vector<at::Tensor> every_operation(Communicator& c) {
  const int r = c.rank(), n = c.size();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(77 + r);
  std::vector<at::Tensor> out;
  for (auto dtype : {at::kFloat, at::kDouble, at::kInt, at::kLong}) {
    auto draw = [&](int64_t numel) {
      return at::isFloatingType(dtype) ? at::randn({numel}, gen).to(dtype)
                                       : at::randint(-50, 50, {numel}, gen).to(dtype);
    };
    for (ReduceOp op : kOps) {
      at::Tensor t = draw(9);
      c.all_reduce(t, op);
      out.push_back(t);
      at::Tensor in = draw(5 * n);
      at::Tensor shard = at::empty({5}, dtype);
      c.reduce_scatter(in, shard, op);
      out.push_back(shard);
    }
    at::Tensor gathered = at::empty({3 * n}, dtype);
    c.all_gather(draw(3), gathered);
    out.push_back(gathered);
    at::Tensor b = draw(4);
    c.broadcast(b, n - 1);
    out.push_back(b);
  }
  CommunicatorPtr half = c.split(r % 2, -r);
  at::Tensor h = at::full({2}, double(r + 1));
  half->all_reduce(h);
  out.push_back(h);
  if (n > 1) {
    at::Tensor from_prev = at::empty({6});
    c.batch_isend_irecv({P2pOp::send(at::randn({6}, gen), (r + 1) % n),
                         P2pOp::recv(from_prev, (r + n - 1) % n)})->wait();
    out.push_back(from_prev);
  }
  return out;
}

TEST(ThreadEngineCommTest, EveryOperationMatchesTheMpiEngine) {
  auto world = test::world();
  const std::vector<at::Tensor> mpi = every_operation(*world);
  std::vector<at::Tensor> threads;
  run_ranks(world->size(), [&](const CommunicatorPtr& comm) {
    auto mine = every_operation(*comm);
    if (comm->rank() == world->rank()) threads = std::move(mine);
  });
  ASSERT_EQ(threads.size(), mpi.size());
  for (size_t i = 0; i < mpi.size(); ++i) {
    const bool exact = !at::isFloatingType(mpi[i].scalar_type()) || world->size() <= 2;
    if (exact) {
      EXPECT_TRUE(threads[i].equal(mpi[i])) << "result " << i << ": " << threads[i] << " vs " << mpi[i];
    } else {
      EXPECT_TRUE(at::allclose(threads[i], mpi[i], 1e-6, 1e-6)) << "result " << i;
    }
  }
  EXPECT_TRUE(test::all_ranks(!HasFailure()));
}

// Note [Polite waits]: collectives issued under a PoliteWaits scope (an asynchronous checkpoint's
// writer) run as non-blocking MPI calls polled with sleeps; they must give bitwise what the
// blocking calls give, every operation and dtype, and the scope must end with its thread's
// previous choice.
TEST(PoliteWaitsCommTest, SameResultsAsTheBlockingCalls) {
  auto world = test::world();
  if (world->backend() != "mpi") GTEST_SKIP() << "the MPI engine's polite waits";
  const std::vector<at::Tensor> blocking = every_operation(*world);
  std::vector<at::Tensor> polite;
  {
    detail::PoliteWaits scope;
    EXPECT_TRUE(detail::polite_waits_here());
    {
      detail::PoliteWaits nested;
    }
    EXPECT_TRUE(detail::polite_waits_here());
    polite = every_operation(*world);
    world->barrier();
  }
  EXPECT_FALSE(detail::polite_waits_here());
  ASSERT_EQ(polite.size(), blocking.size());
  for (size_t i = 0; i < blocking.size(); ++i) {
    EXPECT_TRUE(polite[i].equal(blocking[i])) << "result " << i;
  }
  // Large enough that reduce_scatter's exchange takes more than one piece of polling.
  at::Tensor big = at::full({3 << 20}, float(world->rank() + 1));
  {
    detail::PoliteWaits scope;
    world->all_reduce(big, ReduceOp::Sum);
  }
  const float sum = float(world->size() * (world->size() + 1) / 2);
  EXPECT_TRUE(big.eq(sum).all().item<bool>());
  EXPECT_TRUE(test::all_ranks(!HasFailure()));
}

// A polite wait keeps the deadline: the waiting ranks get the Timeout naming the operation, and
// the late rank's call then completes the polled one (Note [MPI timeouts]).
TEST(PoliteWaitsCommTest, MissingRankTimesOutThenCompletes) {
  auto world = test::world();
  if (world->backend() != "mpi" || world->size() == 1) GTEST_SKIP() << "MPI, a second rank";
  detail::PoliteWaits polite;
  expect_missing_rank_times_out_then_completes(world);
}

}  // namespace
}  // namespace shardopt
