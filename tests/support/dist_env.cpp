// What the multi-rank test environment builds on world() alone, the same for both mains
// (support/mpi_main.cpp, support/thread_main.cpp).
#include <ATen/ATen.h>

#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>

#include "support/dist_env.hpp"
#include "support/first_ranks.hpp"

namespace shardopt::test {

CommunicatorPtr first_ranks(int n) {
  // Per rank (a thread-rank has its own), and per world: thread_tests makes one world per test.
  thread_local const Communicator* cached_world = nullptr;
  thread_local std::map<int, CommunicatorPtr> cache;
  if (cached_world != world().get()) {
    cache.clear();
    cached_world = world().get();
  }
  auto it = cache.find(n);
  if (it != cache.end()) return it->second;
  const int rank = world()->rank();
  return cache[n] = world()->split(rank < n ? 0 : -1, rank);
}

std::string shared_dir(const std::string& tag) {
  std::string path(256, '\0');
  if (world()->rank() == 0) {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp ? tmp : "/tmp") + "/shardopt-" + tag + "-XXXXXX";
    if (!mkdtemp(templ.data())) throw std::runtime_error("mkdtemp failed");
    path.replace(0, templ.size(), templ);
  }
  at::Tensor bytes = at::from_blob(path.data(), {256}, at::kByte);
  world()->broadcast(bytes, 0);
  return std::string(path.c_str());
}

std::unique_lock<std::mutex> seeded_draws(std::optional<uint64_t> seed) {
  static std::mutex generator;
  std::unique_lock<std::mutex> lock(generator);
  if (seed) at::manual_seed(*seed);
  return lock;
}

bool all_ranks(bool ok) {
  at::Tensor flag = at::full({1}, ok ? 1 : 0, at::kInt);
  world()->all_reduce(flag, ReduceOp::Min);
  return flag.item<int>() == 1;
}

}  // namespace shardopt::test
