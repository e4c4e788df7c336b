// Agreement across ranks (Note [Agreement before state changes] in shardopt/checkpoint.hpp):
// agree(), which runs a step on every rank and makes all ranks fail together when any rank
// failed. Internal; checkpoints and the job's set-up (src/job.cpp) use it.
#pragma once

#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "comm/gather_strings.hpp"
#include "shardopt/comm.hpp"

namespace shardopt::detail {

// Runs `body` on every rank and exchanges the outcomes. When any rank failed, `on_failure` runs
// and every rank throws an Error of the first failing rank's kind; otherwise returns each rank's
// payload. `scope` starts the messages ("checkpoint": "shardopt[rank r/N] checkpoint: ...").
// Collective.
std::vector<nlohmann::json> agree(Communicator& comm, Duration timeout, const std::string& what,
                                  const std::string& consequence,
                                  const std::function<nlohmann::json()>& body,
                                  const std::function<void()>& on_failure = nullptr,
                                  const char* scope = "checkpoint");

}  // namespace shardopt::detail
