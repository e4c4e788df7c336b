// The MPI engine. The only public header that includes <mpi.h>.
#pragma once

#include <mpi.h>

#include "shardopt/comm.hpp"

namespace shardopt {

// Wraps `comm` (duplicated, so shardopt's traffic never matches the caller's messages). MPI must be
// initialised already; with MPI_THREAD_SERIALIZED or better, collectives run on a worker thread and
// async calls overlap the caller, otherwise they run on the calling thread.
//
// Note [MPI timeouts]: MPI cannot cancel a collective. When a rank never arrives, Work::wait
// throws Error{Timeout} on the waiting ranks after the deadline, but the engine stays blocked;
// the only safe continuation is to end the job (mpirun then tears down every rank).
CommunicatorPtr make_mpi_communicator(MPI_Comm comm);

}  // namespace shardopt
