// What both example trainers (bert_pretrain, gpt_train) need from their command line beyond
// CLI11: validators whose message names the allowed range in words (CLI11's Range prints its
// type's limits as doubles; CLI11 prefixes the flag), the rank a launcher gave this process
// before any communicator exists, and the one-line usage error every rank agrees on.
// Header-only.
#pragma once

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "shardopt/comm.hpp"

namespace examples {

inline CLI::Validator integer_at_least(int64_t lo) {
  return CLI::Validator(
      [lo](std::string& s) -> std::string {
        int64_t v = 0;
        if (!CLI::detail::lexical_cast(s, v) || v < lo) {
          return fmt::format("expected an integer >= {}, got '{}'", lo, s);
        }
        return "";
      },
      fmt::format("INT>={}", lo));
}

inline CLI::Validator integer_in(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        int64_t v = 0;
        if (!CLI::detail::lexical_cast(s, v) || v < lo || v > hi) {
          return fmt::format("expected an integer in [{}, {}], got '{}'", lo, hi, s);
        }
        return "";
      },
      fmt::format("INT in [{}, {}]", lo, hi));
}

// Real numbers: > lo when `open`, else >= lo; <= hi when hi is finite.
inline CLI::Validator number(double lo, bool open, double hi = HUGE_VAL) {
  const std::string range = hi < HUGE_VAL ? fmt::format("in [{}, {}]", lo, hi)
                                          : fmt::format("{} {}", open ? ">" : ">=", lo);
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(s, v) || !std::isfinite(v) || (open ? v <= lo : v < lo) ||
            v > hi) {
          return fmt::format("expected a number {}, got '{}'", range, s);
        }
        return "";
      },
      "NUMBER " + range);
}

// This process's rank and the world's size as the launcher (mpirun, srun, torchrun) set them;
// 0 and 1 without one.
inline int launcher_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", "RANK"}) {
    if (const char* v = std::getenv(var)) return std::atoi(v);
  }
  return 0;
}

inline int launcher_world_size() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "WORLD_SIZE"}) {
    if (const char* v = std::getenv(var)) return std::max(1, std::atoi(v));
  }
  return 1;
}

// A bad command line: launcher rank 0 alone prints "PROGRAM: error: WHAT", and under a launcher
// the others wait for it, since one may end the job as soon as a rank exits non-zero (OpenMPI 5's
// prterun does). Returns the exit code, 2.
inline int usage_error(const char* program, const std::string& what) {
  if (launcher_rank() == 0) fmt::print(stderr, "{}: error: {}\n", program, what);
  std::fflush(stderr);
  if (launcher_world_size() > 1) {
    try {
      shardopt::init_from_env()->barrier();
    } catch (const std::exception&) {
      // No communicator to be had (a launcher without MPI): nothing to wait with.
    }
  }
  return 2;
}

}  // namespace examples
