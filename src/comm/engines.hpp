// Internal constructors of the engines that init_from_env() picks from; each lives in its own TU
// so that <mpi.h> and the c10d headers stay there.
#pragma once

#include "shardopt/comm.hpp"

namespace shardopt::detail {
// Initialises MPI (MPI_THREAD_SERIALIZED) unless the application did, and wraps MPI_COMM_WORLD.
CommunicatorPtr make_mpi_world_communicator(Duration timeout);
// Gloo over a TCPStore served by rank 0 at host:port (torchrun's convention).
CommunicatorPtr make_gloo_tcp_communicator(int rank, int size, const std::string& host, int port,
                                           Duration timeout);
}  // namespace shardopt::detail
