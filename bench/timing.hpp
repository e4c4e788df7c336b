// Wall-clock helpers of the benchmark programs (step_bench, async_checkpoint_bench,
// profile_bert_step, tp_step).
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace shardopt::bench {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The median (the mean of the middle two for an even count; 0 for none).
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace shardopt::bench
