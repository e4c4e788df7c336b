// Sub-communicators of the first n world ranks, for resharding tests: one mpirun -np 4 covers
// N = 1, 2, 3 (uneven shards) and 4. Defined in mpi_main.cpp.
#pragma once

#include "shardopt/comm.hpp"

namespace shardopt::test {

// A communicator over world ranks [0, n), null on the others. Collective over the world the first
// time each n is asked for (every rank must ask in the same order); cached afterwards.
CommunicatorPtr first_ranks(int n);

}  // namespace shardopt::test
