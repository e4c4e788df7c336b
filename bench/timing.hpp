// Wall-clock helpers of the whole-process benchmarks (profile_bert_step, tp_step).
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace shardopt::bench {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The upper median (v's middle element once sorted; 0 for none).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace shardopt::bench
