// Non-finite gradients at every precision: a NaN/Inf loss on one rank skips the step on every
// rank (fp16 through the loss scaler, fp32/bf16 through the non-finite check), leaving parameters
// and optimizer state bitwise unchanged; repeated non-finite steps end in Error{NonFinite}.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>
#include <map>
#include <optional>

#include "shardopt/detail/shard_access.hpp"
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

// Small buckets (many, most padded), the net's units; fp16 starts at a scale TinyNet's gradients
// never overflow by themselves.
ZeroOptions options_for(int stage, Precision precision, double clip, TinyNet& net) {
  net.upcast = precision != Precision::FP32;
  ZeroOptions zo;
  zo.stage = stage_from_int(stage);
  zo.bucket_bytes = 64;
  zo.units = net.units;
  zo.precision = precision;
  zo.max_grad_norm = clip;
  zo.loss_scale.initial_scale = 1024;
  zo.loss_scale.hysteresis = 1;
  return zo;
}

Fp16Run train_fp16(int stage, const CommunicatorPtr& comm, int poison, int omit,
                   Precision precision = Precision::FP16, double clip = 0.0,
                   float poison_value = std::numeric_limits<float>::infinity()) {
  TinyNet net;
  DistributedOptimizer opt(net.groups(true), make_rule("adamw"), comm,
                           options_for(stage, precision, clip, net));
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

// One planted value, where a check that reads by bucket, by shard or by vector could miss it: the
// last element of the last bucket, and the last element of an earlier bucket, just before that
// bucket's padding. Only the last rank's gradient holds it (its reduced sum lands in one rank's
// shard); every rank must skip, at every stage and precision, and the next step must go ahead.
struct Target {
  std::string name;
  int64_t element = 0;
};

std::vector<Target> planting_targets(DistributedOptimizer& opt) {
  auto& access = detail::shard_access(opt);
  const auto& layout = access.layout();
  auto last_of = [&](int b) -> std::optional<Target> {
    const auto& bl = layout.buckets[b];
    if (bl.pieces.empty()) return std::nullopt;
    const auto& piece = layout.pieces[bl.pieces.back()];
    const std::string& name = access.param_name(piece.param);
    if (name == "unused.weight") return std::nullopt;  // never gets a gradient
    return Target{name, piece.param_offset + piece.numel - 1};
  };
  const int last = static_cast<int>(layout.buckets.size()) - 1;
  std::vector<Target> targets;
  if (auto t = last_of(last)) targets.push_back(*t);
  for (int b = 0; b < last; ++b) {
    const auto& bl = layout.buckets[b];
    if (bl.padded == bl.numel) continue;
    if (auto t = last_of(b)) {
      targets.push_back(*t);
      break;
    }
  }
  return targets;
}

TEST(Precision, PlantedNonFiniteElementSkipsEveryRank) {
  auto comm = test::world();
  const float kValues[] = {std::numeric_limits<float>::quiet_NaN(),
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity()};
  int checked = 0;
  for (Precision precision : {Precision::FP32, Precision::BF16, Precision::FP16}) {
    for (int stage : {0, 1, 2, 3}) {
      for (double clip : {0.0, 0.05}) {
        TinyNet net;
        DistributedOptimizer opt(net.groups(true), make_rule("adamw"), comm,
                                 options_for(stage, precision, clip, net));
        const auto targets = planting_targets(opt);
        ASSERT_EQ(targets.size(), 2u) << "no padded bucket before the last one";
        for (size_t k = 0; k < targets.size(); ++k) {
          const Target& target = targets[k];
          const float value = kValues[(checked + k) % 3];
          const auto name = fmt::format("{} stage {} clip {}: {} at {}[{}]", to_string(precision),
                                        stage, clip, value, target.name, target.element);
          const bool plants = comm->rank() == comm->size() - 1;
          at::Tensor param = net.by_name.at(target.name);
          auto hook = param.register_hook([&](const at::Tensor& g) {
            at::Tensor out = g.clone();
            if (plants) out.view(-1)[target.element] = value;
            return out;
          });
          const int64_t per_rank = kBatch / comm->size();
          auto [x, y] = batch(static_cast<int64_t>(k), 0);
          opt.zero_grad();
          opt.backward(net.loss(x.narrow(0, comm->rank() * per_rank, per_rank),
                                y.narrow(0, comm->rank() * per_rank, per_rank)));
          const auto before = snapshot(net, opt);
          opt.step();
          const bool skipped = opt.last_step().skipped;
          std::string worst;
          const double moved = max_abs_diff(snapshot(net, opt), before, &worst);
          param.remove_hook(hook);
          EXPECT_TRUE(skipped) << name;
          EXPECT_EQ(moved, 0.0) << name << ": the skipped step changed " << worst;
          EXPECT_TRUE(test::all_ranks(skipped && moved == 0.0)) << name;
          // The same batch without the planted value steps.
          opt.zero_grad();
          opt.backward(net.loss(x.narrow(0, comm->rank() * per_rank, per_rank),
                                y.narrow(0, comm->rank() * per_rank, per_rank)));
          opt.step();
          EXPECT_FALSE(opt.last_step().skipped) << name << ": the clean step after";
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 3 * 4 * 2 * 2);
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
