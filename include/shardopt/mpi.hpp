/// \file
/// The MPI engine. The only public header that includes <mpi.h>.
#pragma once

#include <mpi.h>

#include "shardopt/comm.hpp"

namespace shardopt {

/// Wraps `comm` (duplicated, so shardopt's traffic never matches the caller's messages). MPI must
/// be initialised already; with MPI_THREAD_MULTIPLE (what init_from_env asks for), collectives run
/// on a worker thread per communicator and async calls overlap the caller, otherwise they run on
/// the calling thread (every communicator's worker may be inside MPI at once, which SERIALIZED
/// forbids).
///
/// Note [MPI timeouts]: MPI cannot cancel a collective. When a rank never arrives, Work::wait
/// throws Error{Timeout} on the waiting ranks after the deadline, but the engine stays blocked;
/// the only safe continuation is to end the job. shardopt does that itself: when the communicator
/// is destroyed, or the process exits with MPI initialised by init_from_env(), while a collective
/// is still blocked after a timeout, it repeats the timeout on stderr and calls MPI_Abort, so
/// mpirun/srun end every rank promptly instead of hanging in MPI_Finalize. Catch the Error to log
/// or save what you need first; a timed-out collective that completes later aborts nothing.
CommunicatorPtr make_mpi_communicator(MPI_Comm comm);

}  // namespace shardopt
