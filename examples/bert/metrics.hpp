// One training step's metrics: the all-reduced sums of its micro-batches, the metrics.jsonl line
// and the progress output (a bar rewritten in place on a terminal, else a line every
// --log-every steps). Torch-free: train.cpp does the collectives, this the bookkeeping.
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "progress.hpp"
#include "report.hpp"

namespace bert {

// What each rank adds up over a step's micro-batches (then all-reduced).
enum StepSum { kLossSum, kMlmLossSum, kNspLossSum, kMlmCorrect, kMlmCount, kNspCorrect, kRows,
               kTokens, kStepSums };
using StepSums = std::array<double, kStepSums>;

struct StepRecord {
  int64_t step = 0;            // steps done after this one
  StepSums sums{};             // over all ranks and micro-batches
  double micro_batches = 1;    // ranks x micro-steps: what the loss sums are divided by
  double lr = 0, grad_norm = 0;
  int world = 1;
  int64_t global_batch = 0;
  std::vector<double> timings;  // [rank * kTimings + Timing] (report.hpp); rank 0's first
  nlohmann::json memory_rank0;  // by category
  nlohmann::json eval;          // null unless the step evaluated

  double loss() const { return sums[kLossSum] / micro_batches; }
  int64_t tokens() const { return static_cast<int64_t>(sums[kTokens]); }
  double slowest_step_s() const;  // the step's time: its slowest rank's
  std::vector<int64_t> memory_bytes() const;  // per rank
};

// The step's metrics.jsonl object (README: metrics.jsonl).
nlohmann::json metrics_json(const StepRecord& r);

class ProgressLine {
 public:
  // `end_step`: where this run stops (--steps, or earlier with --stop-after); `train_s`: the
  // training seconds of the run so far (a resumed run's included).
  ProgressLine(bool tty, int64_t steps, int64_t end_step, int64_t log_every, int64_t start_step,
               double train_s);
  // After each step: prints when due. `train_s`, `run_samples` and `run_tokens` are totals.
  void step(const StepRecord& r, double train_s, int64_t run_samples, int64_t run_tokens);
  // A line of its own (eval, checkpoint) while the bar is on screen: clears it first.
  std::string prefix() const { return tty_ ? "\r\033[K" : ""; }
  void finish() const;  // ends the bar's line

 private:
  bool tty_;
  int64_t steps_, end_step_, log_every_, start_step_;
  double start_train_s_;
  int64_t shown_step_, shown_samples_ = 0, shown_tokens_ = 0;
  double shown_train_s_;
};

}  // namespace bert
