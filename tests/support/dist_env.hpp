// The multi-rank test environment: the MPI world every dist test runs in, the engines under test,
// and all_ranks(), which agrees on a condition before anyone asserts (an ASSERT that returns on
// one rank before a collective would hang the others).
#pragma once

#include <string>
#include <vector>

#include "shardopt/comm.hpp"

namespace shardopt::test {

// MPI_COMM_WORLD's communicator (set up by the dist main).
CommunicatorPtr world();
// "mpi" or "gloo": one cached communicator per engine, all over the same processes; null when
// this build lacks the engine (tests then GTEST_SKIP with not_built(backend)).
CommunicatorPtr communicator(const std::string& backend);
// Every engine the dist tests know, built or not: a missing one shows as skipped, never vanishes.
std::vector<std::string> backends();
// Why `backend` cannot be tested in this build, e.g. "gloo: built without the c10d/Gloo engine
// (SHARDOPT_WITH_GLOO=OFF)".
std::string not_built(const std::string& backend);
// A fresh Gloo group with its own store, for tests that leave it broken (timeouts); null when this
// build has no Gloo engine.
CommunicatorPtr fresh_gloo(Duration timeout);
// A fresh directory every rank sees (rank 0 makes it under $TMPDIR or /tmp, named after `tag`).
// Collective.
std::string shared_dir(const std::string& tag);
// True when `ok` holds on every rank. Collective: call it on all ranks.
bool all_ranks(bool ok);

}  // namespace shardopt::test
