// Pipeline schedules compiled to action lists (shardopt/pipeline.hpp), checked without torch:
// the validator's rules, deadlock freedom and message order by simulation, the simulated bubble
// against each schedule's formula, and the first stage's peak of micro-batches in flight.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "shardopt/error.hpp"
#include "shardopt/pipeline.hpp"

namespace shardopt {
namespace {

using Kind = PipelineScheduleKind;

struct Case {
  Kind kind;
  int p, m, v;
};

std::string name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string kind = to_string(c.kind);
  for (auto& ch : kind) {
    if (ch == '-') ch = '_';
  }
  return fmt::format("{}_p{}_m{}_v{}", kind == "1f1b" ? "one_f_one_b" : kind, c.p, c.m, c.v);
}

// Every schedule at p in {2, 4}, m in {1, 2, 4, 8}; interleaved at p in 2..4, v in 2..3 and every
// m in p..4p, multiples of p or not (m < p: BadCombinations below).
std::vector<Case> cases() {
  std::vector<Case> out;
  for (int p : {2, 4}) {
    for (int m : {1, 2, 4, 8}) {
      out.push_back({Kind::GPipe, p, m, 1});
      out.push_back({Kind::OneFOneB, p, m, 1});
      out.push_back({Kind::ZeroBubbleH1, p, m, 1});
    }
  }
  for (int p : {2, 3, 4}) {
    for (int v : {2, 3}) {
      for (int m = p; m <= 4 * p; ++m) out.push_back({Kind::Interleaved1F1B, p, m, v});
    }
  }
  return out;
}

class Schedules : public ::testing::TestWithParam<Case> {};

TEST_P(Schedules, ValidAndDeadlockFree) {
  const Case c = GetParam();
  const PipelineSchedule s = compile_schedule(c.kind, c.p, c.m, c.v);
  ASSERT_EQ(static_cast<int>(s.actions.size()), c.p);
  EXPECT_NO_THROW(validate_schedule(s));
  // Each rank runs F and a backward of every (chunk, micro-batch) it owns.
  for (int r = 0; r < c.p; ++r) {
    int forwards = 0, weight_passes = 0;
    for (const Action& a : s.actions[r]) {
      forwards += a.type == ActionType::Forward;
      weight_passes += a.type == ActionType::Backward || a.type == ActionType::BackwardWeight;
    }
    EXPECT_EQ(forwards, c.m * c.v) << "rank " << r;
    EXPECT_EQ(weight_passes, c.m * c.v) << "rank " << r;
  }
}

TEST_P(Schedules, BubbleMatchesFormula) {
  const Case c = GetParam();
  const SimulatedRun run = simulate_schedule(compile_schedule(c.kind, c.p, c.m, c.v));
  const double want = bubble_formula(c.kind, c.p, c.m, c.v);  // Note [Bubble]
  if (c.kind == Kind::ZeroBubbleH1 && c.m < c.p) {
    // (p-1)/(3m) is the steady state's bubble; with fewer micro-batches than ranks no W can
    // fill the ramps (m = 1: F and B cross the pipeline once, 2(p-1)/3). Still below 1F1B's.
    const SimulatedRun one_f_one_b = simulate_schedule(compile_schedule(Kind::OneFOneB, c.p, c.m));
    EXPECT_GE(run.bubble, want - 1e-12);
    EXPECT_LT(run.bubble, one_f_one_b.bubble);
  } else {
    EXPECT_NEAR(run.bubble, want, 1e-12) << "makespan " << run.makespan;
  }
  std::printf("[ bubble   ] %-12s p=%d m=%d v=%d: simulated %.4f, formula %.4f\n",
              to_string(c.kind), c.p, c.m, c.v, run.bubble, want);
}

// Micro-batch-chunks in flight (Forward run, weight gradients not yet) per rank: exact, from each
// schedule's definition, so a schedule that holds more (or fewer) than its design fails here. The
// peak depends only on the lists' order, not on the costs.
int expected_peak(const Case& c, int r) {
  switch (c.kind) {
    case Kind::GPipe: return c.m;  // every forward before any backward
    case Kind::OneFOneB: return std::min(c.p - r, c.m);  // p-1-r warm-up forwards, then one more
    case Kind::ZeroBubbleH1:  // 1F1B's warm-up, W deferred by r: p - r + r on every rank
      return std::min(c.p, c.m);
    case Kind::Interleaved1F1B:  // Megatron's warm-up 2(p-1-r) + (v-1)N forwards, then one more
      return std::min(2 * (c.p - 1 - r) + (c.v - 1) * interleaved_group_size(c.p, c.m) + 1,
                      c.m * c.v);
  }
  return -1;
}

TEST_P(Schedules, PeakInFlightPerRank) {
  const Case c = GetParam();
  const SimulatedRun run = simulate_schedule(compile_schedule(c.kind, c.p, c.m, c.v));
  for (int r = 0; r < c.p; ++r) EXPECT_EQ(run.peak_in_flight[r], expected_peak(c, r)) << "rank " << r;
  // What interleaving buys: with a steady state (m > p) the first rank holds fewer than all m*v.
  // What interleaving buys: with more than one micro-batch group (Note [Micro-batch groups]; m > p
  // when p divides m) the first rank holds fewer than all m*v.
  if (c.kind == Kind::Interleaved1F1B && c.m > interleaved_group_size(c.p, c.m)) {
    EXPECT_LT(run.peak_in_flight[0], c.m * c.v);
  }
}

INSTANTIATE_TEST_SUITE_P(All, Schedules, ::testing::ValuesIn(cases()), name);

TEST(PipelineSchedule, OneFOneBHoldsAtMostPWhereGPipeHoldsM) {
  for (int p : {2, 4}) {
    for (int m : {4, 8}) {
      const auto gpipe = simulate_schedule(compile_schedule(Kind::GPipe, p, m));
      const auto one_f_one_b = simulate_schedule(compile_schedule(Kind::OneFOneB, p, m));
      EXPECT_EQ(gpipe.peak_in_flight[0], m);
      EXPECT_EQ(one_f_one_b.peak_in_flight[0], std::min(p, m));
      // The last rank runs 1F1B from the start: one micro-batch at a time.
      EXPECT_EQ(one_f_one_b.peak_in_flight[p - 1], 1);
    }
  }
}

TEST(PipelineSchedule, OneFOneBListsForTwoRanks) {
  const PipelineSchedule s = compile_schedule(Kind::OneFOneB, 2, 2);
  const auto text = [](const std::vector<Action>& list) {
    std::string out;
    for (const Action& a : list) out += (out.empty() ? "" : " ") + to_string(a);
    return out;
  };
  EXPECT_EQ(text(s.actions[0]), "F0c0 sendA0c0>1 F1c0 sendA1c0>1 recvG0c0<1 B0c0 recvG1c0<1 B1c0");
  EXPECT_EQ(text(s.actions[1]), "recvA0c0<0 F0c0 B0c0 sendG0c0>0 recvA1c0<0 F1c0 B1c0 sendG1c0>0");
}

TEST(PipelineSchedule, ZeroBubbleSplitsBackward) {
  const PipelineSchedule s = compile_schedule(Kind::ZeroBubbleH1, 4, 8);
  for (const auto& list : s.actions) {
    for (const Action& a : list) EXPECT_NE(a.type, ActionType::Backward) << to_string(a);
  }
}

// Unequal costs (F 3, B 2, W 1): ZB-H1 idles (p-1)(F + B - W) per rank where 1F1B idles
// (p-1)(F + B + W) (Qi et al. 2023, section 3.1: W fills what 1F1B's cooldown leaves idle), so
// its bubble is strictly below 1F1B's with the same costs, and its idle time is the paper's.
TEST(PipelineSchedule, ZeroBubbleBeatsOneFOneBAtUnequalCosts) {
  ActionCosts costs;
  costs.forward = 3;
  costs.backward_input = 2;
  costs.backward_weight = 1;
  for (int p : {2, 4}) {
    for (int m : {4, 8}) {
      SCOPED_TRACE(fmt::format("p={} m={}", p, m));
      const SimulatedRun zb = simulate_schedule(compile_schedule(Kind::ZeroBubbleH1, p, m), costs);
      const SimulatedRun one = simulate_schedule(compile_schedule(Kind::OneFOneB, p, m), costs);
      const int64_t per_rank = m * (costs.forward + costs.backward_input + costs.backward_weight);
      EXPECT_EQ(one.makespan - per_rank,
                (p - 1) * (costs.forward + costs.backward_input + costs.backward_weight));
      EXPECT_EQ(zb.makespan - per_rank,
                (p - 1) * (costs.forward + costs.backward_input - costs.backward_weight));
      EXPECT_LT(zb.bubble, one.bubble);
    }
  }
}

TEST(PipelineSchedule, BadCombinationsAreNamedErrors) {
  const auto expect = [](auto fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  // Note [Micro-batch groups]: Megatron-core's p <= N <= m, m % N == 0 or m % N >= p.
  expect([] { compile_schedule(Kind::Interleaved1F1B, 4, 2, 2); }, "at least as many micro");
  expect([] { compile_schedule(Kind::Interleaved1F1B, 2, 1, 2); }, "p <= microbatch_group_size");
  expect([] { compile_schedule(Kind::Interleaved1F1B, 2, 5, 2, 2); }, "m % N == 0 or m % N >= p");
  expect([] { compile_schedule(Kind::Interleaved1F1B, 4, 9, 2, 6); }, "got p = 4, m = 9");
  expect([] { compile_schedule(Kind::Interleaved1F1B, 2, 4, 2, 5); }, "p <= N <= m");
  expect([] { compile_schedule(Kind::OneFOneB, 2, 4, 1, 3); }, "only interleaved takes one");
  expect([] { compile_schedule(Kind::Interleaved1F1B, 2, 4, 1); }, "v >= 2");
  expect([] { compile_schedule(Kind::OneFOneB, 2, 4, 2); }, "only interleaved takes v > 1");
  expect([] { compile_schedule(Kind::GPipe, 0, 4); }, "pipeline ranks p");
  expect([] { compile_schedule(Kind::GPipe, 2, 0); }, "micro-batches m");
  expect([] { parse_schedule_kind("pipedream"); }, "gpipe, 1f1b, interleaved, zb-h1");
  EXPECT_EQ(parse_schedule_kind("zb-h1"), Kind::ZeroBubbleH1);
}

// The validator catches what a hand-edited list gets wrong.
TEST(PipelineSchedule, ValidatorNamesViolations) {
  const auto expect = [](const PipelineSchedule& s, const std::string& needle) {
    try {
      validate_schedule(s);
      ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  {  // two receives swapped on the last rank: the messages arrive in the other order
    PipelineSchedule s = compile_schedule(Kind::GPipe, 2, 2);
    auto& last = s.actions[1];
    std::swap(last[0], last[2]);  // recvA0 F0 recvA1 F1 ... -> recvA1 F0 recvA0 F1
    expect(s, "before");
  }
  {  // the same swap with the forwards too: local order fine, message order wrong
    PipelineSchedule s = compile_schedule(Kind::GPipe, 2, 2);
    auto& last = s.actions[1];
    std::swap(last[0], last[2]);
    std::swap(last[1], last[3]);
    expect(s, "not in the same order");
  }
  {  // rank 0 waits for a gradient before sending the activation it depends on: deadlock
    PipelineSchedule s = compile_schedule(Kind::GPipe, 2, 1);
    auto& first = s.actions[0];  // F0 sendA0 recvG0 B0
    std::swap(first[1], first[2]);
    expect(s, "deadlocks");  // each rank's order is fine alone; together they wait forever
    s = compile_schedule(Kind::OneFOneB, 2, 2);
    // Rank 1's first receive moved to its end: its Forward would run without its input.
    auto& last = s.actions[1];
    std::rotate(last.begin(), last.begin() + 1, last.end());
    expect(s, "recvA0c0<0 before");
  }
  {  // a missing backward
    PipelineSchedule s = compile_schedule(Kind::OneFOneB, 2, 2);
    s.actions[0].pop_back();
    expect(s, "must run either");
  }
}

// Note [Batched exchanges]: the runs of messages between two computes are Megatron's batches. 1F1B
// on a middle rank: send_forward_recv_backward and send_backward_recv_forward; interleaved:
// send_forward_backward_recv_forward_backward, four messages, in the steady state.
TEST(PipelineSchedule, BatchesAreMegatrons) {
  const auto runs = [](const std::vector<Action>& list) {
    std::vector<std::string> out;
    for (size_t i = 0; i < list.size();) {
      const size_t end = exchange_end(list, i);
      std::string run;
      for (size_t k = i; k < end; ++k) {
        run += std::string(run.empty() ? "" : " ") + to_string(list[k].type) + ">" +
               std::to_string(list[k].peer);
      }
      if (!run.empty()) out.push_back(run);
      i = std::max(end, i + 1);
    }
    return out;
  };
  const auto count = [](const std::vector<std::string>& runs, const std::string& run) {
    return std::count(runs.begin(), runs.end(), run);
  };
  const auto one = runs(compile_schedule(Kind::OneFOneB, 4, 8).actions[1]);
  EXPECT_GT(count(one, "sendA>2 recvG>2"), 0);
  EXPECT_GT(count(one, "sendG>0 recvA>0"), 0);
  const auto inter = runs(compile_schedule(Kind::Interleaved1F1B, 4, 8, 2).actions[1]);
  // Rank 1 runs W = 2(p-1-r) + (v-1)N = 8 warm-up iterations, then v*m - W = 8 of F and B, the
  // last of which receives no activation (rank 0's forwards are over).
  EXPECT_EQ(count(inter, "sendA>2 sendG>0 recvA>0 recvG>2"), 8 - 1);
  // Megatron's table for PP2 N3 M5 VP2 (schedules.py): micro-batches 0 1 2 0 1 2 3 4 3 4 on
  // chunks 0 0 0 1 1 1 0 0 1 1.
  std::string forwards;
  const PipelineSchedule n3 = compile_schedule(Kind::Interleaved1F1B, 2, 5, 2, 3);
  for (const Action& a : n3.actions[0]) {
    if (a.type == ActionType::Forward) forwards += fmt::format("{}c{} ", a.microbatch, a.chunk);
  }
  EXPECT_EQ(forwards, "0c0 1c0 2c0 0c1 1c1 2c1 3c0 4c0 3c1 4c1 ");
  EXPECT_EQ(interleaved_group_size(2, 4), 2);  // p divides m: Megatron's default, N = p
  EXPECT_EQ(interleaved_group_size(2, 3), 3);
  EXPECT_EQ(interleaved_group_size(2, 5), 3);  // 5 % 3 = 2 >= p
  EXPECT_EQ(interleaved_group_size(4, 9), 5);  // 9 % 5 = 4 >= p
  EXPECT_EQ(interleaved_group_size(4, 7), 7);  // 7 % 5 = 2 and 7 % 6 = 1 < p: one group
}

// Every compiled schedule runs batched, as Megatron's NCCL path issues it, without deadlock and,
// with unit costs, in the time of separate messages (Note [Bubble] either way). ZB-H1 alone is
// slower batched at m > p (p = 2, m = 4: 14 against 13): a batch of one send waits until the peer
// posts its receive, which ZB-H1 lists after the weight pass W.
TEST_P(Schedules, BatchedExchangesRunWithoutDeadlock) {
  const Case c = GetParam();
  const PipelineSchedule s = compile_schedule(c.kind, c.p, c.m, c.v);
  EXPECT_EQ(exchange_deadlock(s, Exchanges::Batched), "");
  const int64_t batched = simulate_schedule(s, {}, Exchanges::Batched).makespan;
  const int64_t separate = simulate_schedule(s).makespan;
  if (c.kind == Kind::ZeroBubbleH1) {
    EXPECT_GE(batched, separate);
    std::printf("[ batched  ] zb-h1 p=%d m=%d: makespan %lld batched, %lld separate\n", c.p, c.m,
                static_cast<long long>(batched), static_cast<long long>(separate));
  } else {
    EXPECT_EQ(batched, separate);
  }
}

// The interleaved lists with each message next to its compute (the placement before Note
// [Batched exchanges]): what the former pairing ran.
PipelineSchedule adjacent_messages(PipelineSchedule s) {
  const int S = s.stages();
  for (int r = 0; r < s.ranks; ++r) {
    std::vector<Action> list;
    for (const Action& a : s.actions[r]) {
      if (!is_compute(a.type)) continue;
      const auto message = [&](ActionType type, int to) {
        list.push_back(Action{type, a.microbatch, a.chunk, a.stage, to % s.ranks});
      };
      const bool forward = a.type == ActionType::Forward;
      if (forward ? a.stage > 0 : a.stage < S - 1) {
        message(forward ? ActionType::RecvActivation : ActionType::RecvGrad,
                forward ? a.stage - 1 : a.stage + 1);
      }
      list.push_back(a);
      if (forward ? a.stage < S - 1 : a.stage > 0) {
        message(forward ? ActionType::SendActivation : ActionType::SendGrad,
                forward ? a.stage + 1 : a.stage - 1);
      }
    }
    s.actions[r] = list;
  }
  return s;
}

std::string outcome(const PipelineSchedule& s, Exchanges exchanges) {
  const std::string error = exchange_deadlock(s, exchanges);
  if (error.empty()) return "ok";
  return error.find("deadlocks") != std::string::npos ? "deadlock" : "order";
}

// Which lists finish under which semantics (the table in the report): interleaved p 2-4, v 2-3,
// m p..4p. The compiled lists finish separate and batched. The mutation: with each message next
// to its compute, the former pairing (and batching too) deadlocks wherever micro-batches cross
// the ring in more than one group (m > p, p dividing m), which is why run_pipeline refused
// interleaved on NCCL before.
TEST(PipelineSchedule, ExchangeSemanticsTable) {
  std::printf("[ table    ] p v  m  N | compiled: separate batched paired | adjacent: separate "
              "batched paired\n");
  for (int p : {2, 3, 4}) {
    for (int v : {2, 3}) {
      for (int m = p; m <= 4 * p; ++m) {
        SCOPED_TRACE(fmt::format("p={} v={} m={}", p, v, m));
        const PipelineSchedule s = compile_schedule(Kind::Interleaved1F1B, p, m, v);
        const PipelineSchedule old = adjacent_messages(s);
        std::string row;
        for (const auto* lists : {&s, &old}) {
          row += " |";
          for (Exchanges e : {Exchanges::Separate, Exchanges::Batched, Exchanges::Paired}) {
            row += fmt::format(" {:>8}", outcome(*lists, e));
          }
        }
        std::printf("[ table    ] %d %d %2d %2d%s\n", p, v, m, s.group, row.c_str());
        EXPECT_EQ(outcome(s, Exchanges::Separate), "ok");
        EXPECT_EQ(outcome(s, Exchanges::Batched), "ok");
        if (m > p && m % p == 0) {
          EXPECT_EQ(outcome(old, Exchanges::Paired), "deadlock");
          EXPECT_EQ(outcome(old, Exchanges::Batched), "deadlock");
          const std::string why = exchange_deadlock(old, Exchanges::Paired);
          EXPECT_NE(why.find("deadlocks with paired exchanges"), std::string::npos) << why;
        }
      }
    }
  }
}

// run_pipeline agrees on fingerprint() across the pipeline group: equal for equal schedules,
// different for another kind, m, v, or one action moved.
TEST(PipelineSchedule, FingerprintSeesEveryDifference) {
  const PipelineSchedule s = compile_schedule(Kind::OneFOneB, 4, 8);
  EXPECT_EQ(fingerprint(s), fingerprint(compile_schedule(Kind::OneFOneB, 4, 8)));
  EXPECT_NE(fingerprint(s), fingerprint(compile_schedule(Kind::OneFOneB, 4, 9)));
  EXPECT_NE(fingerprint(s), fingerprint(compile_schedule(Kind::GPipe, 4, 8)));
  EXPECT_NE(fingerprint(s), fingerprint(compile_schedule(Kind::OneFOneB, 2, 8)));
  EXPECT_NE(fingerprint(compile_schedule(Kind::Interleaved1F1B, 2, 4, 2)),
            fingerprint(compile_schedule(Kind::Interleaved1F1B, 2, 4, 3)));
  PipelineSchedule moved = s;
  std::swap(moved.actions[2][3], moved.actions[2][4]);
  EXPECT_NE(fingerprint(s), fingerprint(moved));
  PipelineSchedule shifted = s;  // the same actions, one moved from rank 1's list to rank 2's
  shifted.actions[2].insert(shifted.actions[2].begin(), shifted.actions[1].back());
  shifted.actions[1].pop_back();
  EXPECT_NE(fingerprint(s), fingerprint(shifted));
}

TEST(PipelineSchedule, SimulatorReportsDeadlock) {
  PipelineSchedule s = compile_schedule(Kind::GPipe, 2, 1);
  // Both ranks receive first: each waits for the other.
  s.actions[0] = {Action{ActionType::RecvGrad, 0, 0, 0, 1},
                  Action{ActionType::Forward, 0, 0, 0, -1},
                  Action{ActionType::SendActivation, 0, 0, 0, 1},
                  Action{ActionType::Backward, 0, 0, 0, -1}};
  try {
    simulate_schedule(s);
    ADD_FAILURE() << "expected a deadlock";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("deadlocks"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 0 at action 0 (recvG0c0<1)"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace shardopt
