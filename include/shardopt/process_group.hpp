// Adapter from a c10d ProcessGroup (Gloo, NCCL, MPI as built into torch) to a Communicator, plus a
// convenience constructor for Gloo. c10d is forward-declared: its headers cost ~12 s per TU.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <string>

#include "shardopt/comm.hpp"

namespace c10d {
class ProcessGroup;
class Store;
}

namespace shardopt {

// Collectives are issued on `group`; its own timeout applies as well as ours. With the store the
// group was made over, split() makes Gloo subgroups over prefixes of it (as new_group does).
CommunicatorPtr make_process_group_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                c10::intrusive_ptr<c10d::Store> store);
CommunicatorPtr make_process_group_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group);

struct GlooOptions {
  int rank = 0;
  int size = 1;
  // Rendezvous: a file every rank can reach ("file:/path"), or "tcp://host:port" where rank 0
  // serves the store.
  std::string store;
  Duration timeout = default_timeout();
};
// A Gloo process group over loopback/the host's interface, wrapped as a Communicator.
CommunicatorPtr make_gloo_communicator(const GlooOptions& options);

}  // namespace shardopt
