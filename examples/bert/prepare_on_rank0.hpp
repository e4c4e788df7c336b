// The trainer's data preparation across ranks: rank 0 prepares (prepare.hpp), the others learn
// the paths, or rank 0's error, by broadcast.
#pragma once

#include "options.hpp"
#include "prepare.hpp"
#include "shardopt/comm.hpp"

namespace bert {

// Collective. Throws std::runtime_error on every rank when rank 0's preparation failed.
Prepared prepare_on_rank0(const Args& a, shardopt::Communicator& comm);

}  // namespace bert
