/// \file
/// The thread engine: N ranks as threads of one process (backend() "threads"), with the
/// collective and point-to-point semantics of the other engines. For tests, for single-process
/// runs, and for several ranks sharing one GPU (NCCL refuses two ranks on one device); not a
/// replacement for NCCL or MPI across devices or hosts. Note [Thread engine] in
/// src/comm/thread_communicator.cpp says how a collective completes and what the waits mean.
///
///   shardopt::run_ranks(4, [](const shardopt::CommunicatorPtr& comm) {
///     at::Tensor t = at::full({8}, comm->rank());
///     comm->all_reduce(t);                       // 0 + 1 + 2 + 3 on every rank
///   });
#pragma once

#include <functional>
#include <vector>

#include "shardopt/comm.hpp"

namespace shardopt {

/// How run_ranks() and make_thread_communicators() make their communicators.
struct ThreadRanksOptions {
  /// The communicators' timeout: a collective or receive that a rank never joins fails with
  /// Error{Timeout} naming it after this long (sooner when that rank's thread has ended).
  Duration timeout = default_timeout();
};

/// Runs body(comm) on n threads, rank r of one "threads" communicator on thread r, and returns when
/// every thread has ended. Each thread's error messages name its rank ("shardopt[rank r/n]").
/// An exception on one rank ends every rank: their pending and later collectives, receives and
/// barriers throw Error{Communication} naming the failed rank and its message, and once every thread
/// has ended the first failing rank's own exception is rethrown here (as an error on one process
/// ends every process of an MPI job). n must be at least 1.
void run_ranks(int n, const std::function<void(const CommunicatorPtr&)>& body,
               const ThreadRanksOptions& options = {});

/// The n communicators of one thread world, for callers that start their own threads (rank r's is
/// element r). Without run_ranks nothing ends a waiting rank but its timeout.
std::vector<CommunicatorPtr> make_thread_communicators(int n,
                                                       const ThreadRanksOptions& options = {});

/// The rank of the calling thread when it runs a body of run_ranks, else -1.
int thread_rank();

}  // namespace shardopt
