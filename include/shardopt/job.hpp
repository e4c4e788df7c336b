/// \file
/// The job as a whole: an error on one rank must reach every rank, never leave the others waiting
/// in a collective until the timeout. Two tools, for the two kinds of error a trainer has:
///
///  - agree_on_errors(comm, what, body): for work that may fail on some ranks only (rank 0 reads a
///    file, writes JSON, plots; every rank checks its inputs). Every rank runs it and the ranks
///    exchange the outcome before going on; when any rank failed, every rank throws the same
///    shardopt::Error naming the failing ranks and the first one's message. Collective.
///  - abort_job(comm, message): for an error one rank cannot share, because the others may already
///    be inside (or on their way to) a collective it will never join. Prints the message and ends
///    every rank of the job at once: MPI_Abort on MPI; on the other engines this process exits
///    without tearing down, which fails the peers' pending collectives, and the launcher (mpirun,
///    torchrun) ends the rest. Not collective; never returns.
///
/// run_or_abort(comm, body) is the guard for main(): what escapes `body` on one rank of a
/// multi-rank job ends the job with its message (exit code 1) instead of a hang in MPI_Finalize or
/// in the peers' next collective:
///
///   auto comm = shardopt::init_from_env();
///   return shardopt::run_or_abort(*comm, [&] { return train(comm); });
#pragma once

#include <functional>
#include <string>

#include "shardopt/comm.hpp"

namespace shardopt {

/// Runs `body` on every rank; when it throws on any rank, every rank throws Error (the first
/// failing rank's kind; InvalidArgument for exceptions other than shardopt::Error) whose message is
/// that rank's own, or, on the others, "shardopt[rank r/N] job: <what> failed on rank k; ...".
/// Collective: every rank calls it, also one with nothing to do (pass a body that does nothing
/// there).
void agree_on_errors(Communicator& comm, const std::string& what, const std::function<void()>& body);

/// Prints "<message>" and, for a multi-rank job, "shardopt[rank r/N] job: ending every rank" on
/// stderr, then ends the job (see above) with `exit_code`. Never returns.
[[noreturn]] void abort_job(Communicator& comm, const std::string& message, int exit_code = 1);

/// Returns body(). An exception escaping it ends the job through abort_job (with its message and
/// exit code 1) when comm.size() > 1; with one rank it is rethrown.
int run_or_abort(Communicator& comm, const std::function<int()>& body);

}  // namespace shardopt
