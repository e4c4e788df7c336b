// Message assembly for shardopt::Error: "shardopt[rank r/N] <what> (file:line)".
#include "shardopt/error.hpp"

#include <atomic>
#include <cstring>

namespace shardopt {
namespace {
std::atomic<int> g_rank{-1};
std::atomic<int> g_size{0};
// Note [Ranks that are threads]: under the thread engine (run_ranks) every rank is a thread of one
// process, so the rank in messages belongs to the thread: set once per rank thread, it takes the
// place of the process's.
thread_local bool t_thread_rank = false;
thread_local int t_rank = -1;
thread_local int t_size = 0;
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
  if (t_thread_rank) {
    if (size < t_size) return;
    t_rank = rank;
    t_size = size;
    return;
  }
  if (size < g_size.load()) return;
  g_rank = rank;
  g_size = size;
}

namespace detail {
void set_thread_error_rank(int rank, int size) {
  t_thread_rank = rank >= 0;
  t_rank = rank;
  t_size = rank >= 0 ? size : 0;
}

void throw_error(ErrorKind kind, const char* file, int line, const std::string& what) {
  const char* base = std::strrchr(file, '/');
  const int rank = t_thread_rank ? t_rank : g_rank.load();
  const int size = t_thread_rank ? t_size : g_size.load();
  std::string where = rank < 0 ? std::string("shardopt")
                               : fmt::format("shardopt[rank {}/{}]", rank, size);
  throw Error(kind, rank, fmt::format("{} {} ({}:{})", where, what, base ? base + 1 : file, line));
}
}  // namespace detail
}  // namespace shardopt
