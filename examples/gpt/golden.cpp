#include "golden.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

namespace gpt {

namespace {

// Keeps the largest gap and its step; a NaN is the largest of all and stays.
void keep_worst(double gap, int64_t step, double& worst, int64_t& worst_step) {
  if (std::isnan(worst)) return;
  if (std::isnan(gap) || gap > worst) worst = gap, worst_step = step;
}

}  // namespace

void write_golden(const std::string& path, const std::vector<StepRecord>& records) {
  std::ofstream out(path, std::ios::trunc);
  for (const auto& r : records)
    out << fmt::format("{} {:.17g} {:.17g}\n", r.step, r.loss, r.grad_norm);
  if (!out) throw std::runtime_error(fmt::format("--write-golden: cannot write '{}'", path));
  fmt::print("[gpt] golden curve written to {}\n", path);
}

bool matches_golden(const std::string& path, const std::vector<StepRecord>& records,
                    double loss_tol, double norm_tol) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(fmt::format("--golden: cannot read '{}'", path));
  std::map<int64_t, StepRecord> golden;
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    StepRecord r;
    if (!(fields >> r.step >> r.loss)) continue;
    if (!(fields >> r.grad_norm)) r.grad_norm = -1;
    golden[r.step] = r;
  }
  int64_t compared = 0, loss_step = 0, norm_step = 0;
  double loss_gap = 0, norm_gap = 0;
  bool norms_ok = true;
  for (const auto& r : records) {
    const auto it = golden.find(r.step);
    if (it == golden.end()) continue;
    ++compared;
    const double d = std::abs(r.loss - it->second.loss);
    keep_worst(d, r.step, loss_gap, loss_step);
    if (norm_tol < 0) continue;
    if (it->second.grad_norm < 0 || r.grad_norm < 0) {
      norms_ok = false;  // asked to compare norms that were not computed (--max-grad-norm 0)
      continue;
    }
    const double rel =
        std::abs(r.grad_norm - it->second.grad_norm) / std::max(it->second.grad_norm, 1e-30);
    keep_worst(rel, r.step, norm_gap, norm_step);
  }
  const bool ok =
      compared > 0 && loss_gap <= loss_tol && norms_ok && (norm_tol < 0 || norm_gap <= norm_tol);
  const std::string norms =
      norm_tol < 0 ? ""
                   : fmt::format(
                         ", largest |norm - golden| / golden {:.2e} at step {} "
                         "(tolerance {:.1e}){}",
                         norm_gap, norm_step, norm_tol, norms_ok ? "" : ", a norm missing");
  fmt::print(
      "[gpt] golden {}: {} steps compared, largest |loss - golden| {:.2e} at step {} "
      "(tolerance {:.1e}){}: {}\n",
      path, compared, loss_gap, loss_step, loss_tol, norms, ok ? "ok" : "MISMATCH");
  return ok;
}

}  // namespace gpt
