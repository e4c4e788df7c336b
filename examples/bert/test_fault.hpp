// BERT_TEST_FAULT: deterministic faults for bert_pretrain's fault tests (tests/fault/). Header-only;
// included by run.hpp.
#pragma once

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace bert {

// Note [Test faults]: BERT_TEST_FAULT="RANK:STEP:ACTION" makes one rank fail at a chosen point, so
// the fault tests (tests/fault/) never race the clock: `throw` raises an error before training
// step STEP (1-based, outside any collective), `stop` sends SIGSTOP to itself there (a stalled
// rank), `kill-in-save` SIGKILLs itself inside the save of step STEP, after writing its shard,
// `kill-before-commit` once its (pipeline, tensor) folder of that save is complete, before the
// grid's commit (the previous commit stays the one that loads; Note [One commit for a grid]),
// `kill` SIGKILLs itself before step STEP, `kill-in-snapshot` right after the snapshot of step
// STEP started, its buddy exchange and commit still in flight (Note [Snapshots in memory]).
struct TestFault {
  int rank = -1;
  int64_t step = -1;
  std::string action;

  static TestFault from_env() {
    TestFault f;
    const char* env = std::getenv("BERT_TEST_FAULT");
    if (env == nullptr || *env == '\0') return f;
    // A job restarted by scripts/shardopt-run runs without the fault that ended the first attempt.
    if (const char* restart = std::getenv("SHARDOPT_RESTART"); restart != nullptr && std::atoi(restart) > 0) return f;
    char action[32] = {};
    long long step = -1;
    if (std::sscanf(env, "%d:%lld:%31s", &f.rank, &step, action) != 3 ||
        (std::strcmp(action, "throw") != 0 && std::strcmp(action, "stop") != 0 &&
         std::strcmp(action, "kill-in-save") != 0 &&
         std::strcmp(action, "kill-before-commit") != 0 && std::strcmp(action, "kill") != 0 &&
         std::strcmp(action, "kill-in-snapshot") != 0)) {
      throw std::runtime_error(fmt::format(
          "BERT_TEST_FAULT='{}': expected RANK:STEP:ACTION with ACTION throw, stop, kill, "
          "kill-in-save, kill-before-commit or kill-in-snapshot",
          env));
    }
    f.step = step;
    f.action = action;
    return f;
  }
  bool is(const char* what, int r, int64_t s) const { return action == what && rank == r && step == s; }
  // Before training step `s` (1-based) on rank `r`.
  void before_step(int r, int64_t s) const {
    if (is("stop", r, s)) std::raise(SIGSTOP);
    if (is("kill", r, s)) std::raise(SIGKILL);
    if (is("throw", r, s)) {
      throw std::runtime_error(
          fmt::format("test fault (BERT_TEST_FAULT): rank {} fails before step {}", r, s));
    }
  }
};

}  // namespace bert
