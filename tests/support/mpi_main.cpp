// gtest main for tests launched by mpirun: one printer (rank 0), one thread per rank, and a
// process exit code that is the same on every rank (a failure anywhere fails everywhere).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>

#include "shardopt/config.hpp"
#include "shardopt/process_group.hpp"
#include "support/dist_env.hpp"

namespace shardopt::test {
namespace {
CommunicatorPtr g_world;
std::map<std::string, CommunicatorPtr> g_engines;
int g_gloo_groups = 0;

// Rank 0 creates a fresh directory for a FileStore and tells the others its name.
std::string shared_store_path() {
  std::string path(256, '\0');
  if (g_world->rank() == 0) {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp ? tmp : "/tmp") + "/shardopt-test-XXXXXX";
    char* dir = mkdtemp(templ.data());
    if (!dir) throw std::runtime_error("mkdtemp failed");
    path.replace(0, templ.size(), templ);
  }
  at::Tensor bytes = at::from_blob(path.data(), {256}, at::kByte);
  g_world->broadcast(bytes, 0);
  return std::string(path.c_str()) + "/store" + std::to_string(g_gloo_groups++);
}
}  // namespace

CommunicatorPtr world() { return g_world; }

void each_rank(const std::function<void()>& body) { body(); }  // this process is the rank

std::vector<std::string> backends() { return {"mpi", "gloo"}; }

std::string not_built(const std::string& backend) {
  if (backend == "gloo") {
    return "gloo: this build has no c10d/Gloo engine (SHARDOPT_WITH_GLOO=OFF; configure says why)";
  }
  return backend + ": not an engine the dist tests know";
}

CommunicatorPtr fresh_gloo(Duration timeout) {
#if SHARDOPT_HAS_GLOO
  GlooOptions options;
  options.rank = g_world->rank();
  options.size = g_world->size();
  options.store = "file:" + shared_store_path();
  options.timeout = timeout;
  return make_gloo_communicator(options);
#else
  (void)timeout;
  return nullptr;
#endif
}

CommunicatorPtr communicator(const std::string& backend) {
  if (backend == "mpi") return g_world;
  if (backend != "gloo") return nullptr;
  auto& slot = g_engines[backend];
  if (!slot) slot = fresh_gloo(std::chrono::seconds(120));
  return slot;
}

}  // namespace shardopt::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  at::set_num_threads(1);
  shardopt::InitOptions init;
  // SHARDOPT_BACKEND=gloo (tests/multihost's torchrun-style launch) makes the world a Gloo group;
  // communicator("mpi") then is that world.
  init.backend = std::getenv("SHARDOPT_BACKEND") ? "" : "mpi";
  init.timeout = std::chrono::seconds(120);
  shardopt::test::g_world = shardopt::init_from_env(init);
  if (shardopt::test::g_world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  const bool ok = shardopt::test::all_ranks(rc == 0);
  if (shardopt::test::g_world->rank() == 0 && !ok && rc == 0) {
    std::fprintf(stderr, "[dist] a test failed on another rank\n");
  }
  shardopt::test::g_engines.clear();
  shardopt::test::g_world.reset();
  return ok ? 0 : 1;
}
