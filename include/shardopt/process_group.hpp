/// \file
/// Adapter from a c10d ProcessGroup (Gloo, NCCL, MPI as built into torch) to a Communicator, plus a
/// convenience constructor for Gloo. c10d is forward-declared: its headers cost ~12 s per TU.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <string>

#include "shardopt/comm.hpp"

namespace c10d {
class ProcessGroup;
class Store;
}

namespace shardopt {

/// Collectives are issued on `group`; its own timeout applies as well as ours. With the store the
/// group was made over, split() makes Gloo subgroups over prefixes of it (as new_group does).
CommunicatorPtr make_process_group_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                c10::intrusive_ptr<c10d::Store> store);
/// Wraps any torch ProcessGroup (Gloo, NCCL, MPI as built into torch) as a Communicator.
CommunicatorPtr make_process_group_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group);

/// How to make a Gloo communicator of our own (make_gloo_communicator).
struct GlooOptions {
  int rank = 0;  ///< this process's rank
  int size = 1;  ///< the number of ranks
  /// Rendezvous: a file every rank can reach ("file:/path"), or "tcp://host:port" where rank 0
  /// serves the store.
  std::string store;
  Duration timeout = default_timeout();  ///< deadline of every collective
};
/// A Gloo process group over loopback/the host's interface, wrapped as a Communicator.
CommunicatorPtr make_gloo_communicator(const GlooOptions& options);

}  // namespace shardopt
