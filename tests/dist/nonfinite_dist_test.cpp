// Non-finite gradients at every precision: a NaN/Inf loss on one rank skips the step on every
// rank (fp16 through the loss scaler, fp32/bf16 through the non-finite check), leaving parameters
// and optimizer state bitwise unchanged; so does one NaN/Inf planted at the edges of buckets,
// padding and shards (NonFinite.*, its own CTest entries); repeated non-finite steps end in
// Error{NonFinite}.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: not reached through ATen.h on torch 2.x
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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

// One planted value where a check that reads by bucket, by shard or by vector could miss it
// (issue 26): the last element of the last bucket (its padding, or the end of the buffer, follows);
// the last element of an earlier bucket, just before that bucket's padding; the last element of an
// unpadded bucket (the end of the last rank's shard); and the elements either side of a shard
// boundary inside a bucket's parameters (the last of one rank's shard, the first of the next).
// NaN, +Inf and -Inf each at each of them, in one rank's gradient only (rank 1, and the last
// rank), at every stage and precision, with and without clipping. Every rank must skip the step
// with the parameters bitwise as they were, then step on the same batch without it.
struct Target {
  std::string where;  // in the layout
  std::string name;   // the parameter holding it
  int64_t element = 0;
};

std::vector<Target> planting_targets(DistributedOptimizer& opt) {
  auto& access = detail::shard_access(opt);
  const auto& layout = access.layout();
  // The element at offset `at` of bucket b, where a parameter that gets a gradient holds it.
  auto element_at = [&](int b, int64_t at, std::string where) -> std::optional<Target> {
    for (int k : layout.buckets[b].pieces) {
      const auto& piece = layout.pieces[k];
      if (at < piece.offset || at >= piece.offset + piece.numel) continue;
      const std::string& name = access.param_name(piece.param);
      if (name == "unused.weight") return std::nullopt;  // never gets a gradient
      return Target{std::move(where), name, piece.param_offset + at - piece.offset};
    }
    return std::nullopt;
  };
  const int last = static_cast<int>(layout.buckets.size()) - 1;
  std::vector<Target> targets;
  if (auto t = element_at(last, layout.buckets[last].numel - 1, "the last bucket's last element")) {
    targets.push_back(*t);
  }
  for (int b = last - 1; b >= 0; --b) {
    const auto& bl = layout.buckets[b];
    if (bl.padded == bl.numel) continue;
    if (auto t = element_at(b, bl.numel - 1, fmt::format("bucket {}'s last, before padding", b))) {
      targets.push_back(*t);
      break;
    }
  }
  for (int b = last; b >= 0; --b) {  // the end of the last rank's shard, no padding after it
    const auto& bl = layout.buckets[b];
    if (bl.padded != bl.numel) continue;
    if (auto t = element_at(b, bl.numel - 1, fmt::format("bucket {}'s last, unpadded", b))) {
      targets.push_back(*t);
      break;
    }
  }
  for (int b = last; b >= 0; --b) {
    const auto& bl = layout.buckets[b];
    const int64_t boundary = (bl.numel - 1) / bl.shard * bl.shard;  // last shard start in data
    if (boundary == 0) continue;
    const auto before =
        element_at(b, boundary - 1, fmt::format("bucket {}[{}], a shard's last", b, boundary - 1));
    const auto after =
        element_at(b, boundary, fmt::format("bucket {}[{}], a shard's first", b, boundary));
    if (before && after) {
      targets.push_back(*before);
      targets.push_back(*after);
      break;
    }
  }
  return targets;
}

// The parameters as stored (compute dtype), for a bitwise comparison.
std::map<std::string, at::Tensor> raw_snapshot(TinyNet& net, DistributedOptimizer& opt) {
  opt.gather_full_parameters();
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : net.named) out[name] = t.detach().clone();
  return out;
}

// The first parameter whose bits differ, or "".
std::string bitwise_difference(const std::map<std::string, at::Tensor>& a,
                               const std::map<std::string, at::Tensor>& b) {
  for (const auto& [name, t] : a) {
    const auto bits = t.element_size() == 4 ? at::kInt : at::kShort;
    const at::Tensor u = b.at(name);
    if (u.scalar_type() != t.scalar_type() || !at::equal(t.view(bits), u.view(bits))) return name;
  }
  return "";
}

TEST(NonFinite, PlantedElementSkipsEveryRank) {
  auto comm = test::world();
  const int n = comm->size();
  const float kValues[] = {std::numeric_limits<float>::quiet_NaN(),
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity()};
  std::vector<int> planters{std::min(1, n - 1)};
  if (n - 1 != planters.front()) planters.push_back(n - 1);
  const int64_t per_rank = kBatch / n;
  int checked = 0;
  for (Precision precision : {Precision::FP32, Precision::BF16, Precision::FP16}) {
    for (int stage : {0, 1, 2, 3}) {
      for (double clip : {0.0, 0.05}) {
        TinyNet net;
        DistributedOptimizer opt(net.groups(true), make_rule("adamw"), comm,
                                 options_for(stage, precision, clip, net));
        const auto targets = planting_targets(opt);
        // Two edges of padding, the end of an unpadded bucket; with several ranks, a shard
        // boundary too.
        ASSERT_EQ(targets.size(), n > 1 ? 5u : 3u) << "the layout lacks a planting target";
        int64_t s = 0;
        for (const Target& target : targets) {
          for (const float value : kValues) {
            for (const int planter : planters) {
              const auto name =
                  fmt::format("{} stage {} clip {} N = {}: {} on rank {} at {}[{}] ({})",
                              to_string(precision), stage, clip, n, value, planter, target.name,
                              target.element, target.where);
              at::Tensor param = net.by_name.at(target.name);
              auto hook = param.register_hook([&](const at::Tensor& g) {
                at::Tensor out = g.clone();
                if (comm->rank() == planter) out.view(-1)[target.element] = value;
                return out;
              });
              auto [x, y] = batch(s++ % kSteps, 0);
              const at::Tensor xr = x.narrow(0, comm->rank() * per_rank, per_rank);
              const at::Tensor yr = y.narrow(0, comm->rank() * per_rank, per_rank);
              opt.zero_grad();
              opt.backward(net.loss(xr, yr));
              const auto before = raw_snapshot(net, opt);
              opt.step();
              const bool skipped = opt.last_step().skipped;
              const std::string changed = bitwise_difference(raw_snapshot(net, opt), before);
              param.remove_hook(hook);
              EXPECT_TRUE(skipped) << name;
              EXPECT_EQ(changed, "") << name << ": the skipped step changed it";
              EXPECT_TRUE(test::all_ranks(skipped && changed.empty())) << name;
              // The same batch without the planted value steps.
              opt.zero_grad();
              opt.backward(net.loss(xr, yr));
              opt.step();
              EXPECT_FALSE(opt.last_step().skipped) << name << ": the clean step after";
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 3 * 4 * 2 * (n > 1 ? 5 : 3) * 3 * static_cast<int>(planters.size()));
}

// A NaN or Inf written into .grad in place after backward, before step() (gradient surgery, a
// value set by hand): the check during backward saw the values before it, so step() must check
// that bucket again (Note [Gradients written after the check] in src/engine/gradient_reducer.cpp).
// Every rank writes the same element of one parameter at a time (at stage 0 each rank checks its
// own replica of the reduced gradients), through a view of .grad and through .grad itself. Where
// .grad is undefined after backward (bucketed gradients) there is nothing to write.
TEST(NonFinite, WrittenIntoGradAfterBackwardSkipsEveryRank) {
  auto comm = test::world();
  const int64_t per_rank = kBatch / comm->size();
  int written = 0;
  for (int stage : {0, 1, 2, 3}) {
    for (double clip : {0.0, 0.05}) {
      TinyNet net;
      ZeroOptions zo = options_for(stage, Precision::FP32, clip, net);
      zo.max_nonfinite_steps = 0;  // one skipped step per parameter, in a row
      DistributedOptimizer opt(net.groups(true), make_rule("adamw"), comm, zo);
      int64_t s = 0;
      for (const auto& [name, param] : net.by_name) {
        for (const bool whole : {false, true}) {
          auto [x, y] = batch(s++ % kSteps, 0);
          const at::Tensor xr = x.narrow(0, comm->rank() * per_rank, per_rank);
          const at::Tensor yr = y.narrow(0, comm->rank() * per_rank, per_rank);
          opt.zero_grad();
          opt.backward(net.loss(xr, yr));
          at::Tensor g = param.grad();
          if (!g.defined() || name == "unused.weight") continue;  // the same on every rank
          const auto before = raw_snapshot(net, opt);
          {
            at::NoGradGuard no_grad;
            if (whole) {
              g.mul_(std::numeric_limits<float>::infinity());  // Inf, or NaN where it was 0
            } else {
              g.view(-1).narrow(0, g.numel() - 1, 1).fill_(std::nan(""));
            }
          }
          opt.step();
          const auto what = fmt::format("stage {} clip {} N = {}: {} written into {}.grad after "
                                        "backward", stage, clip, comm->size(),
                                        whole ? "Inf" : "NaN", name);
          const bool skipped = opt.last_step().skipped;
          const std::string changed = bitwise_difference(raw_snapshot(net, opt), before);
          EXPECT_TRUE(skipped) << what;
          EXPECT_EQ(changed, "") << what << ": the skipped step changed it";
          EXPECT_TRUE(test::all_ranks(skipped && changed.empty())) << what;
          ++written;
        }
      }
      // The next step is clean again.
      auto [x, y] = batch(0, 0);
      opt.zero_grad();
      opt.backward(net.loss(x.narrow(0, comm->rank() * per_rank, per_rank),
                            y.narrow(0, comm->rank() * per_rank, per_rank)));
      opt.step();
      EXPECT_FALSE(opt.last_step().skipped) << "stage " << stage << ": the clean step after";
    }
  }
  EXPECT_GT(written, 0) << "no stage left .grad defined after backward";
}

// After a clean step a NaN gradient set by hand (no backward since) is checked in step(): the
// check of the last backward covers none of it.
TEST(NonFinite, HandSetAfterCleanStepSkipsEveryRank) {
  auto comm = test::world();
  for (int stage : {0, 1, 2}) {
    TinyNet net;
    DistributedOptimizer opt(net.groups(true), make_rule("adamw"), comm,
                             options_for(stage, Precision::FP32, 0.0, net));
    auto [x, y] = batch(0, 0);
    opt.zero_grad();
    opt.backward(net.loss(x, y));
    opt.step();
    EXPECT_FALSE(opt.last_step().skipped) << "stage " << stage;
    const auto before = raw_snapshot(net, opt);
    for (const auto& [name, param] : net.by_name) {
      at::Tensor g = at::zeros_like(param);
      if (name == "fc2.weight") g.view(-1)[g.numel() / 2] = std::nan("");
      param.mutable_grad() = g;
    }
    opt.step();
    const bool skipped = opt.last_step().skipped;
    const std::string changed = bitwise_difference(raw_snapshot(net, opt), before);
    EXPECT_TRUE(skipped) << "stage " << stage;
    EXPECT_EQ(changed, "") << "stage " << stage;
    EXPECT_TRUE(test::all_ranks(skipped && changed.empty())) << "stage " << stage;
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
