// End-of-run reporting (see report.hpp).
#include "report.hpp"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <fstream>
#include <stdexcept>

#include "progress.hpp"

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
                                 "update_s", "gather_s", "opt_s", "data_s", "cpu_s",
                                 "comm_elements", "step_peak_bytes"};
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

void print_summary(const nlohmann::json& s, const TimingSummary& timing, int64_t first_timed_step,
                   const std::string& summary_path) {
  auto num = [&](const char* key) { return s.at(key).get<double>(); };
  const int64_t step = s.at("step"), ran = s.at("steps_this_run");
  fmt::print("[bert] done: step {} of {} ({} steps in this run, {} of training, {} wall), loss "
             "{:.3f} -> {:.3f} (mean of first/last {}), {}\n",
             step, s.at("steps").get<int64_t>(), ran, human_time(num("train_s_this_run")),
             human_time(num("wall_s")), num("first5_loss"), num("last5_loss"),
             s.at("loss_window").get<int64_t>(),
             format_rates(Rates{num("steps_per_s"), num("samples_per_s"), num("tokens_per_s")}));
  if (s.contains("eval")) {
    const auto &e = s.at("eval"), &f = s.at("first_eval");
    std::string nsp;
    if (s.at("nsp").get<bool>()) {
      nsp = fmt::format("; NSP acc {:.3f} vs majority baseline {:.3f} ({:+.3f})",
                        e.at("nsp_acc").get<double>(), e.at("nsp_baseline").get<double>(),
                        num("nsp_above_baseline"));
    }
    fmt::print("[bert] held-out eval ({} instances): MLM loss {:.3f} (step {}) -> {:.3f} (step {}), "
               "MLM acc {:.3f}{}\n",
               e.at("instances").get<int64_t>(), f.at("mlm_loss").get<double>(),
               f.at("step").get<int64_t>(), e.at("mlm_loss").get<double>(),
               e.at("step").get<int64_t>(), e.at("mlm_acc").get<double>(), nsp);
  }
  if (ran > 0) {
    const auto& t = timing.slowest;
    fmt::print("[bert] step time (median of steps {}-{}, slowest rank {}): {:.4f} s = data {:.4f} + "
               "fwd {:.4f} + bwd {:.4f} + step() {:.4f} (comm wait {:.4f}, update {:.4f}, gather "
               "{:.4f}); process CPU {:.4f} s/step\n",
               first_timed_step, step, timing.slowest_rank, timing.median_step_s,
               t["data_s"].get<double>(), t["fwd_s"].get<double>(), t["bwd_s"].get<double>(),
               t["opt_s"].get<double>(), t["comm_wait_s"].get<double>(),
               t["update_s"].get<double>(), t["gather_s"].get<double>(), t["cpu_s"].get<double>());
  }
  std::string peaks;
  const auto &rss = s.at("peak_rss_bytes"), &tensors = s.at("peak_tensor_bytes");
  for (size_t q = 0; q < rss.size(); ++q) {
    peaks += fmt::format(" r{} {} ({} tensors)", q, human_bytes(rss[q].get<double>()),
                         human_bytes(tensors[q].get<double>()));
  }
  fmt::print("[bert] peak RSS:{}\n", peaks);
  fmt::print("[bert] metrics: {}\n[bert] loss plot: {}\n[bert] summary: {}\n",
             s.at("metrics").get<std::string>(), s.at("plot").get<std::string>(), summary_path);
  const std::string checkpoint = s.at("checkpoint");
  fmt::print("[bert] checkpoint: {}\n",
             checkpoint.empty() ? std::string("none written (no step ran)")
                                : fmt::format("{} (step {}; --resume continues)", checkpoint,
                                              s.at("checkpoint_step").get<int64_t>()));
}

}  // namespace bert
