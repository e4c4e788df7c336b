// all_gather_strings: every rank's string, over any Communicator (the model check compares the
// ranks' parameter lists with it; checkpoints exchange their outcomes). Internal.
#pragma once

#include <string>
#include <vector>

#include "shardopt/comm.hpp"

namespace shardopt::detail {

// Every rank's `mine`, indexed by rank. Collective.
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine,
                                            Duration timeout);

}  // namespace shardopt::detail
