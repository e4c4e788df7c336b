// Compressed gradient communication (ZeroOptions::reduce_dtype): gradients reduced in bf16 while
// training in fp32. One plain SGD step (lr 1) makes the reduced mean gradient visible as the
// parameters' change, p0 - p1; against the exact mean of the ranks' fp32 gradients g_r it must
// stay within the bound options.hpp states, with a factor 2 of margin:
//   |ĝ - ḡ| <= 2 * N * u * mean_r |g_r| + (rounding of p0 - ĝ in fp32),  u = 2^-9,
// and must differ from it (else the test proves nothing). The gradient bytes counted on the wire
// halve. Every stage, flat and hybrid (shard groups of 2 where the world allows).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "shardopt/error.hpp"
#include "shardopt/optimizer.hpp"
#include "support/checkpoint_model.hpp"
#include "support/counting_communicator.hpp"
#include "support/dist_env.hpp"

namespace shardopt {
namespace {

using test::CkptNet;

// Step 0's global batch (test::ckpt_train's), rank q's slice.
std::pair<at::Tensor, at::Tensor> slice(int q, int world) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(500);
  at::Tensor x = at::randint(test::kCkptVocab, {test::kCkptBatch}, gen, at::kLong);
  at::Tensor y = at::randint(test::kCkptVocab, {test::kCkptBatch}, gen, at::kLong);
  const int64_t per = test::kCkptBatch / world;
  return {x.narrow(0, q * per, per), y.narrow(0, q * per, per)};
}

// Per parameter: the exact mean gradient over the ranks and the mean of their magnitudes.
struct Exact {
  std::map<std::string, at::Tensor> mean, mean_abs;
};
Exact exact_gradients(int world) {
  Exact e;
  for (int q = 0; q < world; ++q) {
    CkptNet net;
    auto [x, y] = slice(q, world);
    net.loss(x, y).backward();
    for (auto& [name, t] : net.named) {
      at::Tensor g = t.grad().defined() ? t.grad().detach() : at::zeros_like(t);
      if (!e.mean.count(name)) {
        e.mean[name] = at::zeros_like(g);
        e.mean_abs[name] = at::zeros_like(g);
      }
      e.mean[name] += g / world;
      e.mean_abs[name] += g.abs() / world;
    }
  }
  return e;
}

struct StepResult {
  std::map<std::string, at::Tensor> change;  // p0 - p1 = the reduced mean gradient
  std::map<std::string, at::Tensor> before;
  int64_t reduction_bytes = 0;
};

StepResult one_step(int stage, Precision reduce_dtype, int shard_group) {
  auto world = test::world();
  auto counting = std::make_shared<test::CountingCommunicator>(world);
  CkptNet net;
  ZeroOptions zo;
  zo.stage = stage_from_int(stage);
  zo.bucket_bytes = 64;
  zo.units = net.units;
  zo.reduce_dtype = reduce_dtype;
  zo.shard_group_size = shard_group;
  zo.timeout = std::chrono::seconds(60);
  StepResult run;
  run.before = net.snapshot();
  std::vector<ParamGroup> one_group(1);  // every parameter at lr 1: the change is ĝ
  for (auto& [name, t] : net.named) one_group[0].params.push_back({name, t});
  DistributedOptimizer opt(one_group, SGD(1.0), counting, zo);
  const int64_t before = counting->traffic().reduction_bytes;
  test::ckpt_train(opt, net, 0, 1);
  run.reduction_bytes = counting->traffic().reduction_bytes - before;
  opt.gather_full_parameters();
  for (auto& [name, t] : net.snapshot()) run.change[name] = run.before[name] - t;
  return run;
}

TEST(Compression, Bf16ReductionStaysWithinTheBoundAndHalvesTheBytes) {
  auto world = test::world();
  const int n = world->size();
  const double u = std::ldexp(1.0, -9);
  const Exact exact = exact_gradients(n);
  bool ok = true;
  for (int group : {0, 2}) {
    if (group > 0 && (n % group != 0 || n == group)) continue;
    for (int stage : {0, 1, 2, 3}) {
      const StepResult bf16 = one_step(stage, Precision::BF16, group);
      const StepResult fp32 = one_step(stage, Precision::FP32, group);
      double worst_excess = -1, largest_error = 0, largest_grad = 0;
      std::string worst;
      for (auto& [name, got] : bf16.change) {
        if (name == "frozen.scale") continue;
        const at::Tensor err = (got - exact.mean.at(name)).abs();
        // p0 - (p0 - ĝ) in fp32 loses up to an ulp of the larger operand.
        const at::Tensor bound =
            2 * n * u * exact.mean_abs.at(name) +
            std::ldexp(1.0, -22) * (bf16.before.at(name).abs() + exact.mean.at(name).abs());
        const double excess = (err - bound).max().item<double>();
        if (excess > worst_excess) worst_excess = excess, worst = name;
        largest_error = std::max(largest_error, err.max().item<double>());
        largest_grad = std::max(largest_grad, exact.mean.at(name).abs().max().item<double>());
      }
      const std::string where = fmt::format("stage {} shard group {}", stage, group);
      EXPECT_LE(worst_excess, 0.0) << where << ": " << worst << " exceeds the bound";
      // Compression must show: bf16 keeps 8 bits, so some gradient moves by more than 2^-16.
      EXPECT_GT(largest_error, largest_grad * std::ldexp(1.0, -16)) << where;
      EXPECT_EQ(2 * bf16.reduction_bytes, fp32.reduction_bytes) << where;
      ok = ok && worst_excess <= 0 && largest_error > largest_grad * std::ldexp(1.0, -16) &&
           2 * bf16.reduction_bytes == fp32.reduction_bytes;
    }
  }
  EXPECT_TRUE(test::all_ranks(ok));
}

TEST(Compression, ContradictingOptionsAreNamed) {
  ZeroOptions zo;
  zo.precision = Precision::FP16;
  zo.reduce_in_fp32 = false;
  zo.reduce_dtype = Precision::BF16;
  std::string what;
  try {
    zo.validate();
  } catch (const Error& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("reduce_dtype bf16 contradicts reduce_in_fp32 = false"), std::string::npos)
      << what;
}

}  // namespace
}  // namespace shardopt
