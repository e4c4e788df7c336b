// Agreement across ranks: agree(), which turns one rank's failure into the same Error on every
// rank.
#include "comm/agreement.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <nlohmann/json.hpp>

#include "shardopt/error.hpp"

namespace shardopt::detail {

using json = nlohmann::json;

std::vector<json> agree(Communicator& comm, Duration timeout, const std::string& what,
                        const std::string& consequence, const std::function<json()>& body,
                        const std::function<void()>& on_failure, const char* scope) {
  json mine;
  try {
    mine = {{"ok", true}, {"payload", body()}};
  } catch (const Error& e) {
    mine = {{"ok", false}, {"kind", static_cast<int>(e.kind())}, {"message", e.what()}};
  } catch (const std::exception& e) {
    mine = {{"ok", false},
            {"kind", static_cast<int>(ErrorKind::Checkpoint)},
            {"message", fmt::format("shardopt[rank {}/{}] {}: {}: {}", comm.rank(), comm.size(),
                                    scope, what, e.what())}};
  }
  std::vector<json> all;
  const std::string text = mine.dump(-1, ' ', false, json::error_handler_t::replace);
  for (const auto& s : all_gather_strings(comm, text, timeout)) all.push_back(json::parse(s));
  std::vector<int> failed;
  for (int r = 0; r < comm.size(); ++r) {
    if (!all[r].at("ok").get<bool>()) failed.push_back(r);
  }
  if (failed.empty()) {
    std::vector<json> payloads;
    for (auto& j : all) payloads.push_back(std::move(j["payload"]));
    return payloads;
  }
  if (on_failure) {
    try {
      on_failure();
    } catch (...) {
    }
  }
  const json& first = all[failed.front()];
  const auto kind = static_cast<ErrorKind>(first.at("kind").get<int>());
  std::string message = first.at("message").get<std::string>();
  if (comm.rank() != failed.front()) {
    message = fmt::format(
        "shardopt[rank {}/{}] {}: {} failed on rank{} {}; {}. The error on rank {}: {}",
        comm.rank(), comm.size(), scope, what, failed.size() > 1 ? "s" : "", fmt::join(failed, ", "),
        consequence, failed.front(), message);
  }
  throw Error(kind, comm.rank(), message);
}

}  // namespace shardopt::detail
