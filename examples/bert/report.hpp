// The end of a run: per-rank timing medians, the golden loss comparison. Torch-free.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace bert {

// Per-step timings each rank sends to rank 0 (one all-gather per step), with the step's
// communication (StepStats::comm_elements) and its peak of tracked tensor bytes.
enum Timing { kMemory, kStep, kFwd, kBwd, kCommWait, kUpdate, kGather, kOpt, kData, kCpu,
              kCommElements, kStepPeak, kTimings };

struct TimingSummary {
  nlohmann::json json;  // summary.json's "timing"
  nlohmann::json slowest;  // the per-rank medians of the slowest rank
  int slowest_rank = 0;
  double median_step_s = 0;
};

// Medians over timings[skip..] ([step][rank * kTimings + Timing]) of every field, per rank; the
// run's step time is the slowest rank's median.
TimingSummary summarize_timings(const std::vector<std::vector<double>>& timings, int world,
                                int64_t skip, int64_t global_batch);

// The closing lines of a run ("[bert] done: ...", the held-out eval, the step time of the
// slowest rank from steps `first_timed_step` on, peak memory, where the outputs are), all read
// from summary.json's object `s`.
void print_summary(const nlohmann::json& s, const TimingSummary& timing, int64_t first_timed_step,
                   const std::string& summary_path);

// Writes "step loss" lines.
void write_golden(const std::string& path, const std::vector<double>& losses);
// Compares the losses with a golden file; prints the verdict; false when beyond `tol`.
bool matches_golden(const std::string& path, const std::vector<double>& losses, double tol);

}  // namespace bert
