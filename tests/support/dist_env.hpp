// The multi-rank test environment: the world every dist test runs in, the engines under test,
// and all_ranks(), which agrees on a condition before anyone asserts (an ASSERT that returns on
// one rank before a collective would hang the others).
//
// Two mains provide it. dist_tests (support/mpi_main.cpp) runs under mpirun: the world is
// MPI_COMM_WORLD, one rank per process. thread_tests (support/thread_main.cpp) runs the same test
// bodies on the thread engine: SHARDOPT_TEST_RANKS threads of one process, each its own rank with
// its own world() (shardopt/threads.hpp). A test body that runs on both is written with
// DIST_TEST / DIST_TEST_P, which run it once per rank through each_rank().
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "shardopt/comm.hpp"

namespace shardopt::test {

// The world of this rank: MPI_COMM_WORLD's communicator, or this thread-rank's.
CommunicatorPtr world();
// Runs `body` as every rank's part of one test: under mpirun once (this process is the rank); in
// thread_tests on every thread-rank at once, each seeing its own world(). A failure (or skip) on
// any rank is the test's.
void each_rank(const std::function<void()>& body);
// "mpi" or "gloo": one cached communicator per engine, all over the same processes; null when
// this build lacks the engine (tests then GTEST_SKIP with not_built(backend)). In thread_tests
// "mpi" is the thread world (the engine the binary runs on) and "gloo" is null.
CommunicatorPtr communicator(const std::string& backend);
// Every engine the dist tests know, built or not: a missing one shows as skipped, never vanishes.
std::vector<std::string> backends();
// Why `backend` cannot be tested in this build, e.g. "gloo: built without the c10d/Gloo engine
// (SHARDOPT_WITH_GLOO=OFF)".
std::string not_built(const std::string& backend);
// A fresh Gloo group with its own store, for tests that leave it broken (timeouts); null when this
// build has no Gloo engine.
CommunicatorPtr fresh_gloo(Duration timeout);
// A fresh directory every rank sees (rank 0 makes it under $TMPDIR or /tmp, named after `tag`).
// Collective.
std::string shared_dir(const std::string& tag);
// True when `ok` holds on every rank. Collective: call it on all ranks.
bool all_ranks(bool ok);
// torch's default generator seeded with `seed` (no seed: as it is), held by this rank until the
// returned lock is released. Thread-ranks share that one generator, so the draws every rank must
// make alike (at::randn, a torch::nn::Linear's initialisation) happen under the lock. No
// collective may run while it is held.
std::unique_lock<std::mutex> seeded_draws(std::optional<uint64_t> seed = std::nullopt);

}  // namespace shardopt::test

// A test whose body runs on every rank through each_rank() (dist_tests and thread_tests alike).
#define DIST_TEST(suite, name)                                                   \
  struct suite##_##name##_OnEachRank {                                           \
    static void body();                                                          \
  };                                                                             \
  TEST(suite, name) { ::shardopt::test::each_rank(&suite##_##name##_OnEachRank::body); } \
  void suite##_##name##_OnEachRank::body()

// The same for a value-parameterized test: the body reads its case as `param`.
#define DIST_TEST_P(suite, name)                                                 \
  struct suite##_##name##_OnEachRank {                                           \
    static void body(const suite::ParamType& param);                             \
  };                                                                             \
  TEST_P(suite, name) {                                                          \
    const auto& param = GetParam();                                              \
    ::shardopt::test::each_rank([&param] { suite##_##name##_OnEachRank::body(param); }); \
  }                                                                              \
  void suite##_##name##_OnEachRank::body(const suite::ParamType& param)
