// Shared state of the benchmark binaries: the communicators set up by bench_main.cpp and one set of
// pre-faulted buffers reused by every benchmark (first touch costs ~1.2 GB/s here, docs/design.md).
#pragma once

#include <ATen/ATen.h>
#include <mpi.h>

#include "shardopt/comm.hpp"

namespace shardopt::bench {

extern CommunicatorPtr g_comm;  // the shardopt MPI engine (its own duplicate of MPI_COMM_WORLD)
extern MPI_Comm g_raw_comm;     // a separate MPI_Comm_dup(MPI_COMM_WORLD) for the raw MPI calls

// Two float32 buffers of at least `bytes` each, allocated once (grown when a larger size comes),
// written once to pre-fault them, zero-filled.
struct Buffers {
  at::Tensor a;
  at::Tensor b;
};
Buffers& buffers(int64_t bytes);
void release_buffers();

}  // namespace shardopt::bench
