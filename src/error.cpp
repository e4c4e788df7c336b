// Message assembly for shardopt::Error: "shardopt[rank r/N] <what> (file:line)".
#include "shardopt/error.hpp"

#include <atomic>
#include <cstring>

namespace shardopt {
namespace {
std::atomic<int> g_rank{-1};
std::atomic<int> g_size{0};
}  // namespace

const char* to_string(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::InvalidArgument: return "invalid argument";
    case ErrorKind::Mismatch: return "mismatch across ranks";
    case ErrorKind::Timeout: return "timeout";
    case ErrorKind::Communication: return "communication failure";
    case ErrorKind::Checkpoint: return "checkpoint error";
    case ErrorKind::NonFinite: return "non-finite gradients";
    case ErrorKind::Unsupported: return "unsupported";
    case ErrorKind::Internal: return "internal error";
    case ErrorKind::OutOfMemory: return "out of memory";
  }
  return "unknown";
}

// The largest communicator names the process: a sub-communicator (split) does not replace the
// world's rank in messages.
void set_error_rank(int rank, int size) {
  if (size < g_size.load()) return;
  g_rank = rank;
  g_size = size;
}

namespace detail {
void throw_error(ErrorKind kind, const char* file, int line, const std::string& what) {
  const char* base = std::strrchr(file, '/');
  const int rank = g_rank.load();
  std::string where = rank < 0 ? std::string("shardopt")
                               : fmt::format("shardopt[rank {}/{}]", rank, g_size.load());
  throw Error(kind, rank, fmt::format("{} {} ({}:{})", where, what, base ? base + 1 : file, line));
}
}  // namespace detail
}  // namespace shardopt
