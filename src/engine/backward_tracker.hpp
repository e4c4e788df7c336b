// BackwardTracker: counts micro-steps (backward passes since the last step()) and, within a pass,
// which parameters' gradients arrived, so the engine learns when a stage-3 part has all of its
// gradients. A second hook of one parameter in a pass (reentrant backward) is a duplicate.
#pragma once

#include <cstdint>
#include <vector>

namespace shardopt::detail {

class BackwardTracker {
 public:
  // part_of[i]: parameter i's part (-1: no part is tracked for it).
  BackwardTracker(std::vector<int> part_of, int parts)
      : part_of_(std::move(part_of)), param_pass_(part_of_.size(), -1), parts_(parts) {
    for (int p : part_of_) {
      if (p >= 0) ++parts_[p].size;
    }
  }

  // The first event of a pass starts it (the engine arranges for end_pass()).
  void begin_pass() { in_pass_ = true; }
  bool in_pass() const { return in_pass_; }

  struct Arrival {
    bool duplicate = false;      // already arrived in this pass: nothing to do
    bool part_complete = false;  // the last gradient of its part in this pass
  };
  Arrival arrive(int param) {
    if (param_pass_[param] == pass_) return {/*duplicate=*/true, false};
    param_pass_[param] = pass_;
    const int part = part_of_[param];
    return {false, /*part_complete=*/part >= 0 && count_down(parts_[part])};
  }

  void end_pass() {
    in_pass_ = false;
    ++pass_;
    ++micro_steps_;
  }

  int micro_steps() const { return micro_steps_; }
  // Gradients were set by hand (no backward through the hooks): count it as one micro-step.
  void count_manual_micro_step() {
    if (micro_steps_ < 1) micro_steps_ = 1;
  }
  void reset_micro_steps() { micro_steps_ = 0; }

 private:
  struct Counter {
    int size = 0;
    int pending = 0;
    int64_t pass = -1;  // the pass `pending` refers to
  };
  bool count_down(Counter& c) {
    if (c.pass != pass_) {
      c.pass = pass_;
      c.pending = c.size;
    }
    return --c.pending == 0;
  }

  std::vector<int> part_of_;
  std::vector<int64_t> param_pass_;  // pass in which each parameter's gradient last arrived
  std::vector<Counter> parts_;
  int64_t pass_ = 0;      // backward passes ever
  int micro_steps_ = 0;   // backward passes since the last step()
  bool in_pass_ = false;
};

}  // namespace shardopt::detail
