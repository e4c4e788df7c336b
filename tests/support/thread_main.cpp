// gtest main for thread_tests: the dist tests' bodies (DIST_TEST, DIST_TEST_P) on the thread engine,
// SHARDOPT_TEST_RANKS ranks (default 2) as threads of this one process, no mpirun. Each test
// makes a fresh world (shardopt::run_ranks), so a test that fails cannot leave the next one a
// broken communicator; gtest records every rank's failures and skips against the test.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "shardopt/error.hpp"
#include "shardopt/threads.hpp"
#include "support/dist_env.hpp"

namespace shardopt::test {
namespace {
int g_ranks = 2;
thread_local CommunicatorPtr t_world;

int ranks_from_env() {
  const char* text = std::getenv("SHARDOPT_TEST_RANKS");
  if (text == nullptr || *text == '\0') return 2;
  char* end = nullptr;
  const long n = std::strtol(text, &end, 10);
  SHARDOPT_CHECK(end != text && *end == '\0' && n >= 1 && n <= 64, InvalidArgument,
                 "thread_tests: SHARDOPT_TEST_RANKS must be a number of ranks in [1, 64], got '{}'",
                 text);
  return static_cast<int>(n);
}
}  // namespace

CommunicatorPtr world() {
  // A TEST (not DIST_TEST) that asks for the world runs on gtest's thread, which is no rank.
  if (!t_world) throw std::logic_error("thread_tests: test::world() outside each_rank(); write the test with DIST_TEST");
  return t_world;
}

void each_rank(const std::function<void()>& body) {
  ThreadRanksOptions options;
  options.timeout = std::chrono::seconds(120);
  try {
    run_ranks(g_ranks, [&](const CommunicatorPtr& comm) {
      t_world = comm;
      at::set_num_threads(1);  // as one process per rank with OMP_NUM_THREADS=1
      try {
        body();
      } catch (...) {
        t_world.reset();
        throw;
      }
      t_world.reset();
    }, options);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "a rank threw: " << e.what();
  }
}

std::vector<std::string> backends() { return {"mpi", "gloo"}; }

std::string not_built(const std::string& backend) {
  if (backend == "gloo") {
    return "gloo: thread_tests runs on the thread engine alone (dist_tests runs the Gloo cases)";
  }
  return backend + ": not an engine the dist tests know";
}

CommunicatorPtr fresh_gloo(Duration) { return nullptr; }

CommunicatorPtr communicator(const std::string& backend) {
  return backend == "mpi" ? world() : nullptr;
}

}  // namespace shardopt::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  at::set_num_threads(1);
  shardopt::test::g_ranks = shardopt::test::ranks_from_env();
  std::printf("[thread_tests] %d ranks as threads of one process (SHARDOPT_TEST_RANKS)\n",
              shardopt::test::g_ranks);
  return RUN_ALL_TESTS();
}
