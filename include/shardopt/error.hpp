/// \file
/// shardopt::Error and the checks that raise it. Every user-facing failure is one Error with a
/// kind (what Python maps to ValueError or RuntimeError) and the rank that raised it.
#pragma once

#include <fmt/core.h>
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace shardopt {

/// What kind of failure an Error is (Python maps each to its exception class).
enum class ErrorKind {
  InvalidArgument,  ///< bad options, shapes, dtypes: the caller can fix the call (ValueError)
  Mismatch,         ///< ranks disagree (models, layouts, checkpoints vs models)
  Timeout,          ///< a collective did not complete within its deadline
  Communication,    ///< the engine reported a failure
  Checkpoint,       ///< missing, corrupt or incompatible checkpoint files
  Unsupported,      ///< valid request this build or engine cannot serve
  Internal,         ///< a bug in shardopt
  NonFinite,        ///< NaN/Inf gradients for ZeroOptions::max_nonfinite_steps steps in a row
  OutOfMemory,      ///< an allocation refused: over MemoryTracker's cap (as a device would refuse)
};

/// "InvalidArgument", "Mismatch", ...
const char* to_string(ErrorKind kind);

/// The one exception type shardopt throws: a kind, the rank that raised it and a message naming
/// the problem (`shardopt[rank r/N] <module>: <problem> (file:line)`).
class Error : public std::runtime_error {
 public:
  /// Prefer SHARDOPT_CHECK / SHARDOPT_FAIL, which add the rank and the source location.
  Error(ErrorKind kind, int rank, const std::string& message)
      : std::runtime_error(message), kind_(kind), rank_(rank) {}
  ErrorKind kind() const { return kind_; }  ///< what kind of failure
  /// Rank of the process that raised it, or -1 before any communicator existed.
  int rank() const { return rank_; }

 private:
  ErrorKind kind_;
  int rank_;
};

/// Rank and world size shown in messages; set by the largest communicator of the process so far.
void set_error_rank(int rank, int size);

namespace detail {
// The calling thread is rank `rank` of `size` (the thread engine's rank threads); rank -1 hands
// the thread back to the process's rank. Note [Ranks that are threads] in src/error.cpp.
void set_thread_error_rank(int rank, int size);
[[noreturn]] void throw_error(ErrorKind kind, const char* file, int line, const std::string& what);
}  // namespace detail
}  // namespace shardopt

/// SHARDOPT_CHECK(cond, kind, "fmt", args...): throws shardopt::Error with the message
/// `shardopt[rank r/N] <what> (file:line)`. Write `<what>` as `<module>: <problem>, expected <x>,
/// got <y>`.
#define SHARDOPT_CHECK(cond, kind, ...)                                                        \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      ::shardopt::detail::throw_error(::shardopt::ErrorKind::kind, __FILE__, __LINE__,         \
                                      ::fmt::format(__VA_ARGS__));                             \
    }                                                                                          \
  } while (false)

/// Throws shardopt::Error of `kind` with the formatted message, unconditionally.
#define SHARDOPT_FAIL(kind, ...)                                                               \
  ::shardopt::detail::throw_error(::shardopt::ErrorKind::kind, __FILE__, __LINE__,             \
                                  ::fmt::format(__VA_ARGS__))

/// For our own invariants: a failure here is a shardopt bug, never the user's.
#define SHARDOPT_INTERNAL_ASSERT(cond, ...)                                                    \
  SHARDOPT_CHECK(cond, Internal, "internal error, please report: `{}` failed: {}", #cond,      \
                 ::fmt::format(__VA_ARGS__))
