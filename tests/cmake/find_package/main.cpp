// A downstream project: includes the umbrella header, builds a communicator, runs a collective;
// with MPI it also compiles against shardopt/mpi.hpp (the only public header with <mpi.h>).
#include <ATen/ops/ones.h>
#include <shardopt/shardopt.hpp>

#include <cstdio>

#if CONSUMER_USES_MPI
#include <shardopt/mpi.hpp>
// Referenced, not called: MPI is never initialised in this one-process test.
auto* const kMpiFactory = &shardopt::make_mpi_communicator;
#endif

int main() {
  auto comm = shardopt::make_single_communicator();
  at::Tensor t = at::ones({4});
  comm->all_reduce(t, shardopt::ReduceOp::Sum);
  std::printf("shardopt %s, backend %s, sum %.1f\n", shardopt::version(), comm->backend().c_str(),
              t.sum().item<float>());
  return t.sum().item<float>() == 4.0f ? 0 : 1;
}
