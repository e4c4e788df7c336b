// The dispatcher's cost per operation at stage 3 with automatic units (Note [Automatic units] in
// src/engine/auto_gather.cpp), in microseconds per boxed ATen call: at::add of a small tensor on
//   plain     a tensor without shardopt's key (the baseline),
//   gathered  a gathered parameter: the release guard's key sends the call through the boxed
//             fallback, which finds the part gathered and redispatches below the key,
//   released  released parameters: each call gathers the part it reads (a 1-rank all-gather, a
//             copy) and, three parts rotating through a forward window of two, releases another.
// One process, the single communicator; grad mode off, so autograd adds the same to every row.
//
//   OMP_NUM_THREADS=1 build/bench/dispatch_bench [--numel=N] [--benchmark_repetitions=5]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "shardopt/comm.hpp"
#include "shardopt/optimizer.hpp"

namespace {

int64_t g_numel = 256;  // elements per parameter (small: the call's fixed cost dominates)

// Three parameters named as three elements of a module list: three automatic units.
struct Stage3 {
  std::vector<at::Tensor> params;
  std::unique_ptr<shardopt::DistributedOptimizer> opt;
  Stage3() {
    torch::OrderedDict<std::string, at::Tensor> named;
    for (int i = 0; i < 3; ++i) {
      params.push_back(at::randn({g_numel}).set_requires_grad(true));
      named.insert("layers." + std::to_string(i) + ".weight", params.back());
    }
    shardopt::ZeroOptions zo;
    zo.stage = shardopt::Stage::Parameters;
    zo.unit_policy.persist_below = 0;  // every layer a unit, however small
    zo.prefetch = 0;                   // time the gather on use itself
    opt = std::make_unique<shardopt::DistributedOptimizer>(
        named, shardopt::AdamW(1e-3), shardopt::make_single_communicator(), zo);
  }
};

Stage3& stage3() {
  static Stage3 s;
  return s;
}

void BM_add_plain(benchmark::State& state) {
  at::NoGradGuard no_grad;
  const at::Tensor x = at::randn({g_numel});
  for (auto _ : state) benchmark::DoNotOptimize(at::add(x, 1.0));
}

void BM_add_gathered_parameter(benchmark::State& state) {
  at::NoGradGuard no_grad;
  const at::Tensor& p = stage3().params[0];
  benchmark::DoNotOptimize(at::add(p, 1.0));  // gathers the part once; it stays gathered
  for (auto _ : state) benchmark::DoNotOptimize(at::add(p, 1.0));
}

void BM_add_released_parameter(benchmark::State& state) {
  at::NoGradGuard no_grad;
  auto& params = stage3().params;
  size_t i = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(at::add(params[i], 1.0));  // gathers layers.i, releases layers.i-2
    i = (i + 1) % params.size();
  }
}

BENCHMARK(BM_add_plain)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_add_gathered_parameter)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_add_released_parameter)->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--numel=", 8) == 0) {
      g_numel = std::atoll(argv[i] + 8);
    } else {
      rest.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(rest.size());
  benchmark::Initialize(&n, rest.data());
  if (benchmark::ReportUnrecognizedArguments(n, rest.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
