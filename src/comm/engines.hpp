// Internal constructors of the engines that init_from_env() picks from; each lives in its own TU
// so that <mpi.h> and the c10d headers stay there.
#pragma once

#include <optional>
#include <string>

#include "shardopt/comm.hpp"

namespace shardopt::detail {
// Initialises MPI (asking for MPI_THREAD_MULTIPLE) unless the application did, and wraps
// MPI_COMM_WORLD.
CommunicatorPtr make_mpi_world_communicator(Duration timeout);
// Gloo over a TCPStore at host:port, served by rank 0; or, given agent_prefix, served by torchrun's
// agent (TORCHELASTIC_USE_AGENT_STORE=True): every rank is then a client and keeps its keys under
// the prefix, as torch's own env:// rendezvous does.
CommunicatorPtr make_gloo_tcp_communicator(int rank, int size, const std::string& host, int port,
                                           Duration timeout,
                                           const std::optional<std::string>& agent_prefix = {});
}  // namespace shardopt::detail

namespace shardopt::detail {
// "send([4] float32 cpu to rank 1) on mpi": the description of one point-to-point message.
std::string describe_p2p(const P2pOp& op, const std::string& backend);
// Throws Error{Mismatch}: the message `op` awaited from its peer is of another dtype or size
// (Note [Point-to-point messages]). `got` describes what arrived, e.g. "8 x int32".
[[noreturn]] void fail_p2p_mismatch(const P2pOp& op, const std::string& backend,
                                    const std::string& got);
}  // namespace shardopt::detail
