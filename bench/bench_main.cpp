// MPI-aware Google Benchmark main: every rank runs the same benchmarks in the same order (the
// timings they feed back are agreed over MPI, so their iteration counts agree too); rank 0 prints,
// the others report to a null reporter.
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 build/bench/collectives_bench
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <cstring>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "shardopt/comm.hpp"

namespace shardopt::bench {

CommunicatorPtr g_comm;
MPI_Comm g_raw_comm = MPI_COMM_NULL;

namespace {
class NullReporter final : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};
}  // namespace

}  // namespace shardopt::bench

int main(int argc, char** argv) {
  using namespace shardopt::bench;
  at::set_num_threads(1);
  shardopt::InitOptions init;
  init.backend = "mpi";
  g_comm = shardopt::init_from_env(init);  // MPI_Init_thread(MULTIPLE) + the shardopt engine
  MPI_Comm_dup(MPI_COMM_WORLD, &g_raw_comm);  // raw MPI calls never share shardopt's communicator
  const int rank = g_comm->rank();

  // Only rank 0 writes --benchmark_out (every rank would otherwise open and truncate the file).
  std::vector<char*> args(argv, argv + argc);
  if (rank != 0) {
    std::vector<char*> kept;
    for (char* a : args) {
      if (std::strncmp(a, "--benchmark_out", 15) != 0) kept.push_back(a);
    }
    args = kept;
  }
  int n_args = static_cast<int>(args.size());
  benchmark::Initialize(&n_args, args.data());
  if (benchmark::ReportUnrecognizedArguments(n_args, args.data())) return 1;
  if (rank == 0) {
    benchmark::AddCustomContext("mpi_ranks", std::to_string(g_comm->size()));
    benchmark::AddCustomContext("shardopt_backend", g_comm->backend());
    benchmark::RunSpecifiedBenchmarks();
  } else {
    NullReporter null;
    benchmark::RunSpecifiedBenchmarks(&null);
  }
  benchmark::Shutdown();
  release_buffers();
  MPI_Comm_free(&g_raw_comm);
  g_comm.reset();  // before MPI_Finalize (shardopt finalises MPI at exit: it initialised it)
  return 0;
}
