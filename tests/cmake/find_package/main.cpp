// A downstream project: includes the umbrella header, builds a communicator, runs a collective.
#include <ATen/ops/ones.h>
#include <shardopt/shardopt.hpp>

#include <cstdio>

int main() {
  auto comm = shardopt::make_single_communicator();
  at::Tensor t = at::ones({4});
  comm->all_reduce(t, shardopt::ReduceOp::Sum);
  std::printf("shardopt %s, backend %s, sum %.1f\n", shardopt::version(), comm->backend().c_str(),
              t.sum().item<float>());
  return t.sum().item<float>() == 4.0f ? 0 : 1;
}
