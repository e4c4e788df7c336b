// fault_stall: each rank trains a tiny model; after one step the last rank stops itself with
// SIGSTOP, so the others' next step times out. tests/fault/stall_test.sh checks that the whole
// job then ends within the timeout + 10 s with the timeout on stderr.
// Usage: fault_stall <timeout seconds> <work dir> [<communicator timeout seconds>]
//   (writes <dir>/rank<r>.pid, <dir>/stalled). The optimizer's ZeroOptions::timeout is the first;
//   the communicator is created with the third (default: the same), so a test can show that the
//   optimizer's timeout governs even when the process group was made with a long one.
#include <ATen/ATen.h>
#include <torch/ordered_dict.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "shardopt/shardopt.hpp"

int main(int argc, char** argv) {
  using namespace shardopt;
  if (argc != 3 && argc != 4) {
    std::fprintf(stderr, "usage: %s <timeout seconds> <work dir> [<communicator timeout seconds>]\n",
                 argv[0]);
    return 2;
  }
  const std::string dir = argv[2];
  const std::chrono::seconds timeout(std::atoi(argv[1]));
  InitOptions init;
  init.timeout = argc == 4 ? std::chrono::seconds(std::atoi(argv[3])) : timeout;
  try {
    auto comm = init_from_env(init);
    std::ofstream(dir + "/rank" + std::to_string(comm->rank()) + ".pid") << ::getpid() << "\n";
    at::manual_seed(0);
    torch::OrderedDict<std::string, at::Tensor> named;
    named.insert("w", at::randn({64, 64}).set_requires_grad(true));
    named.insert("b", at::zeros({64}).set_requires_grad(true));
    ZeroOptions zo;
    zo.stage = Stage::Gradients;
    zo.timeout = timeout;
    DistributedOptimizer opt(named, AdamW(0.01), comm, zo);
    auto train_step = [&] {
      opt.zero_grad();
      at::Tensor x = at::randn({8, 64});
      opt.backward((x.matmul(named["w"]) + named["b"]).pow(2).mean());
      opt.step();
    };
    train_step();
    if (comm->rank() == comm->size() - 1) {
      std::ofstream(dir + "/stalled") << "stalled\n";
      std::raise(SIGSTOP);
    }
    train_step();
    std::printf("rank %d: the second step completed\n", comm->rank());
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
