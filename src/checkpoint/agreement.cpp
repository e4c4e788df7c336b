// Agreement across ranks: a string all-gather over the communicator, and agree(), which turns
// one rank's failure into the same Error on every rank.
#include "checkpoint/agreement.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cstring>

#include "checkpoint/format.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail {

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine,
                                            Duration timeout) {
  const int world = comm.size();
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lens = at::empty({world}, at::kLong);
  comm.all_gather(len, lens, true)->wait(timeout);
  const int64_t width = std::max<int64_t>(1, lens.max().item<int64_t>());
  at::Tensor buf = at::zeros({width}, at::kByte);
  std::memcpy(buf.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({world * width}, at::kByte);
  comm.all_gather(buf, all, true)->wait(timeout);
  std::vector<std::string> out;
  const auto* p = static_cast<const char*>(all.data_ptr());
  const auto* n = lens.data_ptr<int64_t>();
  for (int r = 0; r < world; ++r) out.emplace_back(p + r * width, static_cast<size_t>(n[r]));
  return out;
}

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
  for (const auto& s : all_gather_strings(comm, dump(mine), timeout)) all.push_back(json::parse(s));
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
