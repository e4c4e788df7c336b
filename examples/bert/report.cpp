// End-of-run reporting (see report.hpp).
#include "report.hpp"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <fstream>
#include <stdexcept>

namespace bert {

namespace {
double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
}  // namespace

TimingSummary summarize_timings(const std::vector<std::vector<double>>& timings, int world,
                                int64_t skip, int64_t global_batch) {
  const char* names[kTimings] = {"memory_bytes", "step_s", "fwd_s", "bwd_s", "comm_wait_s",
                                 "update_s", "gather_s", "opt_s", "data_s", "cpu_s"};
  TimingSummary s;
  nlohmann::json per_rank = nlohmann::json::array();
  for (int r = 0; r < world; ++r) {
    nlohmann::json t;
    for (int f = kStep; f < kTimings; ++f) {
      std::vector<double> v;
      for (size_t k = static_cast<size_t>(skip); k < timings.size(); ++k) {
        v.push_back(timings[k][r * kTimings + f]);
      }
      t[names[f]] = median(v);
    }
    if (r == 0 || t["step_s"].get<double>() > s.median_step_s) {
      s.median_step_s = t["step_s"].get<double>(), s.slowest_rank = r;
    }
    per_rank.push_back(t);
  }
  s.slowest = per_rank[s.slowest_rank];
  s.json = {{"timed_steps", static_cast<int64_t>(timings.size()) - skip},
            {"warmup_steps", skip},
            {"median_step_s", s.median_step_s},
            {"samples_per_s", static_cast<double>(global_batch) / std::max(s.median_step_s, 1e-9)},
            {"per_rank_median", per_rank}};
  return s;
}

void write_golden(const std::string& path, const std::vector<double>& losses) {
  std::ofstream g(path, std::ios::trunc);
  for (size_t i = 0; i < losses.size(); ++i) g << fmt::format("{} {:.6f}\n", i + 1, losses[i]);
  fmt::print("[bert] golden losses written to {}\n", path);
}

bool matches_golden(const std::string& path, const std::vector<double>& losses, double tol) {
  std::ifstream g(path);
  if (!g) throw std::runtime_error("--golden: cannot read '" + path + "'");
  int64_t step = 0, compared = 0, worst_step = 0;
  double expected = 0, worst = 0;
  while (g >> step >> expected) {
    if (step < 1 || step > static_cast<int64_t>(losses.size())) continue;
    const double d = std::abs(losses[static_cast<size_t>(step - 1)] - expected);
    if (d > worst) worst = d, worst_step = step;
    ++compared;
  }
  const bool ok = compared > 0 && worst <= tol;
  fmt::print("[bert] golden {}: {} steps compared, largest |loss - golden| {:.2e} at step {} "
             "(tolerance {:.1e}): {}\n", path, compared, worst, worst_step, tol,
             ok ? "ok" : "MISMATCH");
  return ok;
}

}  // namespace bert
