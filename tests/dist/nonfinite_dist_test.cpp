// Non-finite gradients at every precision: a NaN/Inf loss on one rank skips the step on every
// rank (fp16 through the loss scaler, fp32/bf16 through the non-finite check), leaving parameters
// and optimizer state bitwise unchanged; repeated non-finite steps end in Error{NonFinite}.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>
#include <map>

#include "shardopt/error.hpp"
#include "shardopt/optimizer.hpp"
#include "support/dist_env.hpp"
#include "support/tiny_net.hpp"

namespace shardopt {
namespace {

using test::batch;
using test::kBatch;
using test::kSteps;
using test::make_rule;
using test::max_abs_diff;
using test::TinyNet;

// fp16 with a loss scaler: at step `poison` the last rank's loss becomes Inf. Every rank must
// skip that step, leave parameters and optimizer state as they were, and halve the scale.
struct Fp16Run {
  std::map<std::string, at::Tensor> params, before, after;  // final; around the poisoned step
  std::vector<bool> skipped;
  std::vector<double> scale_after;
  std::vector<int> nonfinite;  // last_step().nonfinite_steps
};

std::map<std::string, at::Tensor> snapshot(TinyNet& net, DistributedOptimizer& opt) {
  opt.gather_full_parameters();
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : net.named) out[name] = t.detach().to(at::kFloat, false, true);
  return out;
}

Fp16Run train_fp16(int stage, const CommunicatorPtr& comm, int poison, int omit,
                   Precision precision = Precision::FP16, double clip = 0.0,
                   float poison_value = std::numeric_limits<float>::infinity()) {
  TinyNet net;
  net.upcast = precision != Precision::FP32;
  ZeroOptions zo;
  zo.stage = stage_from_int(stage);
  zo.bucket_bytes = 64;
  zo.units = net.units;
  zo.precision = precision;
  zo.max_grad_norm = clip;
  zo.loss_scale.initial_scale = 1024;
  zo.loss_scale.hysteresis = 1;
  DistributedOptimizer opt(net.groups(true), make_rule("adamw"), comm, zo);
  const int64_t per_rank = kBatch / comm->size();
  Fp16Run run;
  for (int64_t s = 0; s < kSteps; ++s) {
    if (s == omit) continue;
    opt.zero_grad();
    auto [x, y] = batch(s, 0);
    at::Tensor loss = net.loss(x.narrow(0, comm->rank() * per_rank, per_rank),
                               y.narrow(0, comm->rank() * per_rank, per_rank));
    if (s == poison && comm->rank() == comm->size() - 1) {
      loss = loss * poison_value;
    }
    opt.backward(loss);
    if (s == poison) run.before = snapshot(net, opt);
    opt.step();
    if (s == poison) run.after = snapshot(net, opt);
    run.skipped.push_back(opt.last_step().skipped);
    run.scale_after.push_back(opt.last_step().loss_scale);
    run.nonfinite.push_back(opt.last_step().nonfinite_steps);
  }
  run.params = snapshot(net, opt);
  return run;
}

TEST(Precision, InfOnOneRankSkipsTheStepEverywhere) {
  auto comm = test::world();
  constexpr int kPoison = 3;
  for (int stage : {0, 1, 2, 3}) {
    const Fp16Run poisoned = train_fp16(stage, comm, kPoison, -1);
    const Fp16Run omitted = train_fp16(stage, comm, -1, kPoison);
    bool ok = true;
    for (int s = 0; s < kSteps; ++s) {
      const bool expect = s == kPoison;
      EXPECT_EQ(poisoned.skipped[s], expect) << "stage " << stage << " step " << s;
      ok = ok && poisoned.skipped[s] == expect;
    }
    for (bool skipped : omitted.skipped) ok = ok && !skipped;
    // The scale used by the poisoned step was 1024; the next steps run at 512.
    EXPECT_EQ(poisoned.scale_after[kPoison], 1024.0);
    EXPECT_EQ(poisoned.scale_after[kPoison + 1], 512.0);
    std::string worst;
    const double moved = max_abs_diff(poisoned.after, poisoned.before, &worst);
    EXPECT_EQ(moved, 0.0) << "stage " << stage << ": the skipped step changed " << worst;
    // Same trajectory as never seeing that batch: the optimizer state and step count were
    // untouched too (Adam's bias correction would differ otherwise).
    const double diff = max_abs_diff(poisoned.params, omitted.params, &worst);
    EXPECT_LE(diff, 1e-6) << "stage " << stage << ", worst " << worst;
    EXPECT_TRUE(test::all_ranks(ok && moved == 0.0 && diff <= 1e-6));
  }
}

// Without loss scaling (fp32, bf16) a NaN or Inf loss on the last rank skips the step on every
// rank too, with and without clipping (the clip's global norm is the check there): parameters
// bitwise unchanged, and the run continues as if that batch had never been seen.
TEST(Precision, NonFiniteOnOneRankSkipsAtFp32AndBf16) {
  auto comm = test::world();
  constexpr int kPoison = 3;
  for (Precision precision : {Precision::FP32, Precision::BF16}) {
    for (int stage : {0, 1, 2, 3}) {
      for (double clip : {0.0, 0.05}) {
        const float value = clip > 0 ? std::numeric_limits<float>::quiet_NaN()
                                     : std::numeric_limits<float>::infinity();
        const auto name = fmt::format("{} stage {} clip {}", to_string(precision), stage, clip);
        const Fp16Run poisoned = train_fp16(stage, comm, kPoison, -1, precision, clip, value);
        const Fp16Run omitted = train_fp16(stage, comm, -1, kPoison, precision, clip);
        bool ok = true;
        for (int s = 0; s < kSteps; ++s) {
          const bool expect = s == kPoison;
          EXPECT_EQ(poisoned.skipped[s], expect) << name << " step " << s;
          EXPECT_EQ(poisoned.nonfinite[s], expect ? 1 : 0) << name << " step " << s;
          ok = ok && poisoned.skipped[s] == expect && poisoned.nonfinite[s] == (expect ? 1 : 0);
        }
        for (bool skipped : omitted.skipped) ok = ok && !skipped;
        std::string worst;
        const double moved = max_abs_diff(poisoned.after, poisoned.before, &worst);
        EXPECT_EQ(moved, 0.0) << name << ": the skipped step changed " << worst;
        const double diff = max_abs_diff(poisoned.params, omitted.params, &worst);
        EXPECT_LE(diff, 1e-6) << name << ", worst " << worst;
        EXPECT_TRUE(test::all_ranks(ok && moved == 0.0 && diff <= 1e-6)) << name;
      }
    }
  }
}

// max_nonfinite_steps skipped steps in a row end in Error{NonFinite} on every rank.
TEST(Precision, RepeatedNonFiniteStepsThrowOnEveryRank) {
  auto comm = test::world();
  TinyNet net;
  ZeroOptions zo;
  zo.stage = Stage::Gradients;
  zo.max_nonfinite_steps = 3;
  DistributedOptimizer opt(net.groups(false), AdamW(0.01), comm, zo);
  auto [x, y] = batch(0, 0);
  int thrown_at = -1;
  std::string what;
  for (int s = 0; s < 5 && thrown_at < 0; ++s) {
    opt.zero_grad();
    at::Tensor loss = net.loss(x, y);
    if (comm->rank() == comm->size() - 1) loss = loss * std::numeric_limits<float>::quiet_NaN();
    opt.backward(loss);
    try {
      opt.step();
      EXPECT_TRUE(opt.last_step().skipped);
      EXPECT_EQ(opt.last_step().nonfinite_steps, s + 1);
    } catch (const Error& e) {
      thrown_at = e.kind() == ErrorKind::NonFinite ? s : 100;
      what = e.what();
    }
  }
  EXPECT_EQ(thrown_at, 2) << what;
  EXPECT_NE(what.find("3 consecutive steps"), std::string::npos) << what;
  EXPECT_TRUE(test::all_ranks(thrown_at == 2));
}

}  // namespace
}  // namespace shardopt
