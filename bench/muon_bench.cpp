// muon_bench: DistributedOptimizer::step() with Muon (rules.hpp) at N = 1, 2, 4 thread-ranks of
// one process (the thread engine), on `--matrices` equal-sized square matrices, rounds
// interleaved (the order of N rotates every round). Every rank runs its kernels on one thread
// (at::set_num_threads(1)), so N ranks use N cores; T(N) is the median over steps of the slowest
// rank's step() (after a barrier). Printed: T(N), the ratio T(N) / (T(1) / N) (issue 56's bound:
// at most 1.15), and the step's phases of the slowest rank (Newton-Schulz time, exchanged bytes).
// With --ns-dtype 16 / 32 / 64 it also says which Newton-Schulz dtype is faster here.
//
//   build/bench/muon_bench                                  # 8 x 512x512, bf16, stage 1
//   build/bench/muon_bench --ranks 1,2 --ns-dtype 32 --rounds 5
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "shardopt/shardopt.hpp"
#include "timing.hpp"

namespace {

using shardopt::bench::Clock;
using shardopt::bench::median;

struct Sample {
  double step_s = 0, update_s = 0, ns_s = 0;
  int64_t exchange_bytes = 0, orthogonalized = 0;
};

// One round at `ranks` thread-ranks: builds the optimizer (untimed), `warmup` + `steps` steps;
// returns the slowest rank's figures per timed step.
std::vector<Sample> run_round(int ranks, int64_t matrices, int64_t width, int stage,
                              double ns_dtype, int warmup, int steps) {
  std::vector<Sample> out(static_cast<size_t>(steps));
  shardopt::run_ranks(ranks, [&](const shardopt::CommunicatorPtr& comm) {
    std::vector<at::Tensor> params, grads;
    {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
      for (int64_t m = 0; m < matrices; ++m) {
        params.push_back((at::randn({width, width}, gen) * 0.02).set_requires_grad(true));
        grads.push_back(at::randn({width, width}, gen));
      }
    }
    shardopt::ParamGroup group;
    for (size_t i = 0; i < params.size(); ++i) group.params.push_back({fmt::format("w{}", i), params[i]});
    shardopt::ZeroOptions zo;
    zo.stage = shardopt::stage_from_int(stage);
    shardopt::DistributedOptimizer opt({group}, shardopt::Muon(0.02).ns_dtype(ns_dtype), comm, zo);
    for (int s = 0; s < warmup + steps; ++s) {
      opt.zero_grad();
      at::Tensor loss = at::zeros({}, at::kFloat);
      for (size_t i = 0; i < params.size(); ++i) loss = loss + (params[i] * grads[i]).sum();
      opt.backward(loss);
      comm->barrier();
      const auto t0 = Clock::now();
      opt.step();
      const double dt = shardopt::bench::seconds_since(t0);
      const auto& st = opt.last_step();
      at::Tensor v = at::tensor({dt, st.update_s, st.orthogonalize_s,
                                 static_cast<double>(st.exchange_bytes)}, at::kDouble);
      at::Tensor count = at::tensor({st.orthogonalized}, at::kLong);
      comm->all_reduce(v, shardopt::ReduceOp::Max);
      comm->all_reduce(count, shardopt::ReduceOp::Sum);
      if (comm->rank() == 0 && s >= warmup) {
        auto* a = v.data_ptr<double>();
        out[s - warmup] = {a[0], a[1], a[2], static_cast<int64_t>(a[3]), count.item<int64_t>()};
      }
    }
  });
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"muon_bench: Muon's step() at N thread-ranks against T(1)/N"};
  std::vector<int> ranks{1, 2, 4};
  int64_t matrices = 8, width = 512;
  int stage = 1, rounds = 3, warmup = 1, steps = 3;
  std::vector<double> ns_dtypes{16};
  app.add_option("--ranks", ranks, "thread-rank counts, the first 1")->delimiter(',');
  app.add_option("--matrices", matrices, "equal-sized square matrices");
  app.add_option("--width", width, "their side");
  app.add_option("--stage", stage, "ZeRO stage 0-3");
  app.add_option("--ns-dtype", ns_dtypes, "Newton-Schulz dtype(s): 16 (bf16), 32, 64")->delimiter(',');
  app.add_option("--rounds", rounds, "interleaved rounds");
  app.add_option("--steps", steps, "timed steps per round (after one warm-up)");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);  // one core per rank
  std::map<std::pair<double, int>, std::vector<Sample>> all;
  for (int round = 0; round < rounds; ++round) {
    for (size_t d = 0; d < ns_dtypes.size(); ++d) {
      for (size_t k = 0; k < ranks.size(); ++k) {
        const int n = ranks[(k + round) % ranks.size()];
        const double dtype = ns_dtypes[(d + round) % ns_dtypes.size()];
        auto samples = run_round(n, matrices, width, stage, dtype, warmup, steps);
        auto& keep = all[{dtype, n}];
        keep.insert(keep.end(), samples.begin(), samples.end());
      }
    }
  }
  fmt::print("muon_bench: {} x {}x{} matrices, stage {}, {} rounds x {} steps, one thread per "
             "rank\n", matrices, width, width, stage, rounds, steps);
  for (double dtype : ns_dtypes) {
    auto med = [&](int n, double Sample::*f) {
      std::vector<double> v;
      for (const auto& s : all[{dtype, n}]) v.push_back(s.*f);
      return median(v);
    };
    const double t1 = med(1, &Sample::step_s);
    for (int n : ranks) {
      const auto& s = all[{dtype, n}];
      const double t = med(n, &Sample::step_s);
      fmt::print("ns_dtype {:>2}  N={}  step {:8.4f} s  update {:8.4f} s  newton-schulz {:8.4f} s "
                 " exchange {:>9} B  orthogonalised {}/{}  T(N)/(T(1)/N) = {:.3f}\n",
                 dtype, n, t, med(n, &Sample::update_s), med(n, &Sample::ns_s),
                 s.empty() ? 0 : s.back().exchange_bytes, s.empty() ? 0 : s.back().orthogonalized,
                 matrices, t1 > 0 ? t / (t1 / n) : 0.0);
    }
  }
  return 0;
}
