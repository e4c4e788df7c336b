// Progress output helpers (see progress.hpp).
#include "progress.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fmt/format.h>

namespace bert {

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  return fmt::format("{:.1f} {}", b, units[u]);
}

std::string human_time(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const auto t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02d}m", t / 3600, (t % 3600) / 60);
  if (t >= 60) return fmt::format("{}m{:02d}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

bool progress_on_terminal(const std::string& mode) {
  if (mode == "tty") return true;
  if (mode == "lines") return false;
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID"}) {
    if (std::getenv(var)) return false;
  }
  return ::isatty(STDOUT_FILENO) != 0;
}

Rates rates(int64_t steps, int64_t samples, int64_t tokens, double seconds) {
  Rates r;
  if (seconds <= 0) return r;
  r.steps_per_s = static_cast<double>(steps) / seconds;
  r.samples_per_s = static_cast<double>(samples) / seconds;
  r.tokens_per_s = static_cast<double>(tokens) / seconds;
  return r;
}

std::string format_rates(const Rates& r) {
  return fmt::format("{:.2f} steps/s, {:.1f} samples/s, {:.0f} tokens/s", r.steps_per_s,
                     r.samples_per_s, r.tokens_per_s);
}

std::string progress_bar(int64_t done, int64_t total, int width) {
  const double f = total > 0 ? std::clamp(static_cast<double>(done) / total, 0.0, 1.0) : 0.0;
  const int filled = static_cast<int>(f * width);
  return fmt::format("[{}{}] {:3.0f}%", std::string(filled, '#'), std::string(width - filled, '.'),
                     100 * f);
}

}  // namespace bert
