// Step metrics and the progress line (see metrics.hpp).
#include "metrics.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>

namespace bert {

double StepRecord::slowest_step_s() const {
  double slowest = 0;
  for (int k = 0; k < world; ++k) slowest = std::max(slowest, timings[k * kTimings + kStep]);
  return slowest;
}

std::vector<int64_t> StepRecord::memory_bytes() const {
  std::vector<int64_t> m;
  for (int k = 0; k < world; ++k) m.push_back(static_cast<int64_t>(timings[k * kTimings + kMemory]));
  return m;
}

nlohmann::json metrics_json(const StepRecord& r) {
  const auto& s = r.sums;
  const double* mine = r.timings.data();  // rank 0's breakdown
  const double slowest = r.slowest_step_s();
  nlohmann::json j;
  j["step"] = r.step;
  j["loss"] = r.loss();
  j["mlm_loss"] = s[kMlmLossSum] / r.micro_batches;
  j["nsp_loss"] = s[kNspLossSum] / r.micro_batches;
  j["mlm_acc"] = s[kMlmCount] > 0 ? s[kMlmCorrect] / s[kMlmCount] : 0.0;
  j["nsp_acc"] = s[kRows] > 0 ? s[kNspCorrect] / s[kRows] : 0.0;
  j["lr"] = r.lr;
  j["grad_norm"] = r.grad_norm;
  j["step_time_s"] = slowest;
  j["data_s"] = mine[kData];
  j["fwd_s"] = mine[kFwd];
  j["bwd_s"] = mine[kBwd];
  j["opt_s"] = mine[kOpt];  // the step() call: comm_wait_s + update_s + gather_s + clipping
  j["comm_wait_s"] = mine[kCommWait];  // reductions not finished when backward ended
  j["update_s"] = mine[kUpdate];
  j["gather_s"] = mine[kGather];
  j["cpu_s"] = mine[kCpu];  // process CPU time of the step (all threads, rank 0)
  j["comm_elements"] = mine[kCommElements];  // sent into collectives by rank 0 (StepStats)
  j["step_peak_bytes"] = mine[kStepPeak];     // tracked tensor bytes at most during the step
  const auto step_rates = rates(1, r.global_batch, r.tokens(), slowest);
  j["steps_per_s"] = step_rates.steps_per_s;  // global: the slowest rank's step time
  j["samples_per_s"] = step_rates.samples_per_s;
  j["tokens_per_s"] = step_rates.tokens_per_s;
  j["memory_bytes"] = r.memory_bytes();
  j["memory_rank0"] = r.memory_rank0;
  if (!r.eval.is_null()) j["eval"] = r.eval;
  return j;
}

ProgressLine::ProgressLine(bool tty, int64_t steps, int64_t end_step, int64_t log_every,
                           int64_t start_step, double train_s)
    : tty_(tty), steps_(steps), end_step_(end_step), log_every_(log_every),
      start_step_(start_step), start_train_s_(train_s), shown_step_(start_step),
      shown_train_s_(train_s) {}

void ProgressLine::step(const StepRecord& r, double train_s, int64_t run_samples,
                        int64_t run_tokens) {
  const int64_t done = r.step;
  const bool show = tty_ || done % log_every_ == 0 || done == start_step_ + 1 || done == end_step_;
  if (!show) return;
  // Rates over the training time since the previous line (the whole run on a terminal).
  const auto shown = tty_ ? rates(done - start_step_, run_samples, run_tokens, train_s - start_train_s_)
                          : rates(done - shown_step_, run_samples - shown_samples_,
                                  run_tokens - shown_tokens_, train_s - shown_train_s_);
  shown_step_ = done, shown_samples_ = run_samples, shown_tokens_ = run_tokens;
  shown_train_s_ = train_s;
  const double per_step = (train_s - start_train_s_) / static_cast<double>(done - start_step_);
  std::string mem_text;
  const auto mem = r.memory_bytes();
  for (int k = 0; k < r.world; ++k) mem_text += fmt::format(" r{} {}", k, human_bytes(mem[k]));
  const auto& s = r.sums;
  const std::string line = fmt::format(
      "{}step {:>{}}/{} | loss {:.3f} | mlm {:.3f} acc {:.3f} | nsp {:.3f} acc {:.2f} | {} | "
      "lr {:.2e} | ETA {} | mem{}",
      tty_ ? progress_bar(done, steps_) + " " : "", done, std::to_string(steps_).size(), steps_,
      r.loss(), s[kMlmLossSum] / r.micro_batches, s[kMlmCount] > 0 ? s[kMlmCorrect] / s[kMlmCount] : 0.0,
      s[kNspLossSum] / r.micro_batches, s[kRows] > 0 ? s[kNspCorrect] / s[kRows] : 0.0,
      format_rates(shown), r.lr, human_time(per_step * static_cast<double>(end_step_ - done)),
      mem_text);
  if (tty_) fmt::print("\r\033[K{}", line);
  else fmt::print("{}\n", line);
  std::fflush(stdout);
}

void ProgressLine::finish() const {
  if (tty_) fmt::print("\n");
}

}  // namespace bert
