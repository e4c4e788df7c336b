// shardopt's MPI engine vs the raw MPI calls on the same pre-faulted float32 buffers:
//   reduce_scatter  Communicator::reduce_scatter  vs MPI_Reduce_scatter_block
//   all_gather      Communicator::all_gather      vs MPI_Allgather
//   all_reduce      Communicator::all_reduce      vs MPI_Allreduce (in place)
// for 1, 4, 16, 64, 256 MiB (the full buffer: the reduce-scatter input, the all-gather output).
//
// Timing: a barrier, then the call, timed on every rank; the iteration's time is the maximum over
// ranks (MPI_Allreduce MAX), fed to Google Benchmark as manual time, so all ranks agree on every
// decision (iteration counts) and a collective counts as finished when its slowest rank is.
// Counters as nccl-tests define them (doc/PERFORMANCE.md there), bytes = the full buffer:
//   algbw = bytes / time; busbw = algbw * 2(n-1)/n (all_reduce), * (n-1)/n (reduce_scatter,
//   all_gather). GB/s = 10^9 bytes/s.
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "bench_common.hpp"

namespace shardopt::bench {

Buffers& buffers(int64_t bytes) {
  static Buffers buf;
  const int64_t numel = (bytes + 3) / 4;
  if (!buf.a.defined() || buf.a.numel() < numel) {
    buf = Buffers{};  // free the smaller ones first
    buf.a = at::zeros({numel}, at::kFloat);  // zeros() writes every page: pre-faulted
    buf.b = at::zeros({numel}, at::kFloat);
  }
  return buf;
}

void release_buffers() {
  Buffers& b = buffers(0);
  b.a = at::Tensor();
  b.b = at::Tensor();
}

namespace {

enum class Op { ReduceScatter, AllGather, AllReduce };

const char* name(Op op) {
  switch (op) {
    case Op::ReduceScatter: return "reduce_scatter";
    case Op::AllGather: return "all_gather";
    case Op::AllReduce: return "all_reduce";
  }
  return "?";
}

double bus_factor(Op op, int n) {
  return op == Op::AllReduce ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
}

void run_collective(benchmark::State& state, Op op, bool raw) {
  const int n = g_comm->size();
  const int64_t requested = state.range(0);
  const int64_t shard = requested / 4 / n;  // elements per rank
  const int64_t full = shard * n;           // the full buffer, a multiple of n
  const int64_t bytes = full * 4;
  Buffers& buf = buffers(requested);
  const at::Tensor full_a = buf.a.narrow(0, 0, full);
  const at::Tensor full_b = buf.b.narrow(0, 0, full);
  const at::Tensor shard_b = buf.b.narrow(0, 0, shard);
  const at::Tensor shard_a = buf.a.narrow(0, 0, shard);
  const int count = static_cast<int>(shard);

  auto once = [&] {
    switch (op) {
      case Op::ReduceScatter:  // full input a -> shard output b
        if (raw) {
          MPI_Reduce_scatter_block(full_a.data_ptr(), shard_b.data_ptr(), count, MPI_FLOAT, MPI_SUM,
                                   g_raw_comm);
        } else {
          g_comm->reduce_scatter(full_a, shard_b, ReduceOp::Sum);
        }
        break;
      case Op::AllGather:  // shard input a -> full output b
        if (raw) {
          MPI_Allgather(shard_a.data_ptr(), count, MPI_FLOAT, full_b.data_ptr(), count, MPI_FLOAT,
                        g_raw_comm);
        } else {
          g_comm->all_gather(shard_a, full_b);
        }
        break;
      case Op::AllReduce:  // in place on a
        if (raw) {
          MPI_Allreduce(MPI_IN_PLACE, full_a.data_ptr(), static_cast<int>(full), MPI_FLOAT, MPI_SUM,
                        g_raw_comm);
        } else {
          g_comm->all_reduce(full_a, ReduceOp::Sum);
        }
        break;
    }
  };

  once();  // warm-up: MPI connections, shardopt's scratch buffer, OpenMPI's free lists
  double total = 0;
  for (auto _ : state) {
    MPI_Barrier(g_raw_comm);
    const double t0 = MPI_Wtime();
    once();
    double elapsed = MPI_Wtime() - t0, slowest = 0;
    MPI_Allreduce(&elapsed, &slowest, 1, MPI_DOUBLE, MPI_MAX, g_raw_comm);
    state.SetIterationTime(slowest);
    total += slowest;
  }
  const double algbw = static_cast<double>(bytes) * static_cast<double>(state.iterations()) / total / 1e9;
  state.counters["algbw_GBps"] = algbw;
  state.counters["busbw_GBps"] = algbw * bus_factor(op, n);
  state.counters["MiB"] = static_cast<double>(bytes) / (1 << 20);
  state.SetLabel(raw ? "raw MPI" : "shardopt mpi");
}

// Side by side: for each size, each op, shardopt then raw MPI.
const bool registered = [] {
  for (int64_t mib : {1, 4, 16, 64, 256}) {
    for (Op op : {Op::ReduceScatter, Op::AllGather, Op::AllReduce}) {
      for (bool raw : {false, true}) {
        const std::string label = std::string(name(op)) + (raw ? "/raw_mpi" : "/shardopt");
        benchmark::RegisterBenchmark(label.c_str(), [op, raw](benchmark::State& s) {
          run_collective(s, op, raw);
        })
            ->Arg(mib << 20)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
  return true;
}();

}  // namespace
}  // namespace shardopt::bench
