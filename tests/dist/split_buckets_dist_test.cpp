// Buckets that split parameters: every stage against single-process torch (<= 1e-6 after 10
// steps) when parameters are larger than a bucket, when one parameter spans three buckets and
// two ranks (so LAMB's per-tensor norms add partial sums from several buckets and ranks), and
// with 64-byte buckets; with accumulation and clipping; and the bucket pool stays within its bound
// (Note [Bucket pool bound]) of buffers of at most one bucket each, whatever the largest parameter.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/types.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <map>

#include "shardopt/detail/partition.hpp"
#include "shardopt/detail/plan.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/units.hpp"
#include "support/dist_env.hpp"
#include "support/reference_lamb.hpp"
#include "support/reference_loop.hpp"

namespace shardopt {
namespace {

constexpr int64_t kVocab = 10, kDim = 12, kHidden = 20, kBatch = 12, kSteps = 10;

// How stage 3 sees the tied embedding/decoder: in no unit; as one unit run twice per forward
// (at the lookup and at the decoder); or declared by two units (the lookup, and the head with
// its bias), so that it gets a part of its own.
enum class Embed { Loose, RunTwice, Shared };

// A tied embedding/decoder (120 elements), two layers of 240-element weights (stage-3 units
// fc1, fc2), a decoder bias and a parameter that never gets a gradient (both in no unit unless
// Embed::Shared puts the bias in the head unit).
struct SplitNet {
  std::vector<std::pair<std::string, at::Tensor>> named;
  std::map<std::string, at::Tensor> by_name;
  UnitsPtr units = std::make_shared<Units>();
  Embed embed = Embed::Loose;
  int lookup_unit = -1, decoder_unit = -1;

  explicit SplitNet(Embed e = Embed::Loose) : embed(e) {
    at::manual_seed(99);
    add("embed.weight", at::randn({kVocab, kDim}));
    add("fc1.weight", at::randn({kDim, kHidden}) * 0.4);
    add("fc1.bias", at::randn({kHidden}) * 0.1);
    add("fc2.weight", at::randn({kHidden, kDim}) * 0.4);
    add("fc2.bias", at::randn({kDim}) * 0.1);
    add("head.bias", at::randn({kVocab}) * 0.1);
    add("unused.weight", at::randn({5}));
    named.emplace_back("decoder.weight", by_name["embed.weight"]);  // tied
    units->add("fc1", {by_name["fc1.weight"], by_name["fc1.bias"]});
    units->add("fc2", {by_name["fc2.weight"], by_name["fc2.bias"]});
    if (e == Embed::RunTwice) {
      lookup_unit = decoder_unit = units->add("embed", {by_name["embed.weight"]});
    } else if (e == Embed::Shared) {
      lookup_unit = units->add("embeddings", {by_name["embed.weight"]});
      decoder_unit = units->add("head", {by_name["embed.weight"], by_name["head.bias"]});
    }
  }
  // Runs fn inside unit `u`, or directly when the embedding is in no unit.
  template <typename Fn>
  at::Tensor in_unit(int u, Fn&& fn) {
    return u < 0 ? fn() : units->run(u, fn);
  }
  void add(const std::string& name, at::Tensor t) {
    t = t.contiguous().set_requires_grad(true);
    named.emplace_back(name, t);
    by_name[name] = t;
  }
  at::Tensor loss(const at::Tensor& x, const at::Tensor& y) {
    at::Tensor h = in_unit(lookup_unit, [&] { return at::embedding(by_name["embed.weight"], x); });
    h = units->run(0, [&] {
      return at::tanh(at::matmul(h, by_name["fc1.weight"]) + by_name["fc1.bias"]);
    });
    h = units->run(1, [&] { return at::matmul(h, by_name["fc2.weight"]) + by_name["fc2.bias"]; });
    at::Tensor logits = in_unit(decoder_unit, [&] {
      return at::matmul(h, by_name["embed.weight"].t()) + by_name["head.bias"];
    });
    return at::nll_loss(at::log_softmax(logits, 1), y);
  }
  std::vector<ParamGroup> groups() {
    ParamGroup g;
    for (auto& [name, t] : named) g.params.push_back({name, t});
    return {g};
  }
  std::vector<at::Tensor> unique_params() {
    std::vector<at::Tensor> out;
    for (auto& [name, t] : named) {
      if (name != "decoder.weight") out.push_back(t);
    }
    return out;
  }
};

std::pair<at::Tensor, at::Tensor> batch(int64_t s, int64_t m) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(500 + s * 16 + m);
  return {at::randint(kVocab, {kBatch}, gen, at::kLong),
          at::randint(kVocab, {kBatch}, gen, at::kLong)};
}

struct Case {
  int stage = 0;
  std::string rule;
  int64_t bucket_bytes = 64;
  int64_t align_bytes = 64;
  int accumulation = 1;
  double clip = 0.0;
  Embed embed = Embed::Loose;
};

std::string case_name(const Case& c) {
  return fmt::format("stage{}_{}_b{}_a{}{}{}{}", c.stage, c.rule, c.bucket_bytes, c.align_bytes,
                     c.accumulation > 1 ? fmt::format("_accum{}", c.accumulation) : "",
                     c.clip > 0 ? "_clip" : "",
                     c.embed == Embed::RunTwice ? "_embed_twice"
                     : c.embed == Embed::Shared ? "_embed_shared" : "");
}

Rule make_rule(const std::string& name) {
  if (name == "adamw") return AdamW(0.01).weight_decay(0.05);
  if (name == "sgd") return SGD(0.05).momentum(0.9).dampening(0.1).weight_decay(0.01);
  return Lamb(0.01).weight_decay(0.01);
}

std::map<std::string, at::Tensor> train_reference(const Case& c) {
  namespace o = torch::optim;
  SplitNet net;
  auto ps = net.unique_params();
  const Rule rule = make_rule(c.rule);
  std::unique_ptr<o::Optimizer> opt;
  if (const auto* a = std::get_if<AdamW>(&rule)) {
    opt = std::make_unique<o::AdamW>(ps, o::AdamWOptions(a->lr()).betas({a->beta1(), a->beta2()})
                                             .eps(a->eps()).weight_decay(a->weight_decay()));
  } else if (const auto* s = std::get_if<SGD>(&rule)) {
    opt = std::make_unique<o::SGD>(ps, o::SGDOptions(s->lr()).momentum(s->momentum())
                                           .dampening(s->dampening())
                                           .weight_decay(s->weight_decay()));
  }
  test::LambMoments moments;
  test::train_reference_loop(
      ps, kSteps, c.accumulation, c.clip,
      [&](const at::Tensor& x, const at::Tensor& y) { return net.loss(x, y); }, batch,
      [&](int64_t s) {
        if (opt) {
          opt->step();
        } else {
          test::reference_lamb_step(ps, std::get<Lamb>(rule), s + 1, moments);
        }
      });
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : net.named) out[name] = t.detach().clone();
  return out;
}

struct Sharded {
  std::map<std::string, at::Tensor> params;
  MemoryReport memory;
  int64_t comm_per_step = 0;  // elements last_step() reports
};

Sharded train_sharded(const Case& c, const CommunicatorPtr& comm) {
  SplitNet net(c.embed);
  ZeroOptions zo;
  zo.stage = stage_from_int(c.stage);
  zo.bucket_bytes = c.bucket_bytes;
  zo.align_bytes = c.align_bytes;
  zo.grad_accumulation_steps = c.accumulation;
  zo.max_grad_norm = c.clip;
  zo.timeout = std::chrono::seconds(60);
  zo.units = net.units;
  DistributedOptimizer opt(net.groups(), make_rule(c.rule), comm, zo);
  const int64_t per_rank = kBatch / comm->size();
  Sharded run;
  for (int64_t s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    for (int m = 0; m < c.accumulation; ++m) {
      auto [x, y] = batch(s, m);
      opt.backward(net.loss(x.narrow(0, comm->rank() * per_rank, per_rank),
                            y.narrow(0, comm->rank() * per_rank, per_rank)));
    }
    opt.step();
    run.comm_per_step = opt.last_step().comm_elements;
  }
  run.memory = opt.memory();
  opt.gather_full_parameters();
  for (auto& [name, t] : net.named) run.params[name] = t.detach().clone();
  return run;
}

class SplitBucketParity : public ::testing::TestWithParam<Case> {};

TEST_P(SplitBucketParity, MatchesSingleProcessTorch) {
  const Case& c = GetParam();
  auto comm = test::world();
  const auto reference = train_reference(c);
  const Sharded run = train_sharded(c, comm);
  double diff = 0;
  std::string worst;
  for (auto& [name, t] : run.params) {
    const double d = (t - reference.at(name)).abs().max().item<double>();
    if (d > diff) diff = d, worst = name;
  }
  EXPECT_LE(diff, 1e-6) << "worst parameter: " << worst;
  // Training moved the parameters.
  SplitNet initial;
  EXPECT_GT((run.params.at("fc1.weight") - initial.by_name["fc1.weight"]).abs().max().item<double>(),
            1e-3);
  // Bucketed gradients: at most kBucketPoolBuffers pooled buffers, each one bucket (bucket_bytes
  // rounded to world * align), although fc1.weight alone is 960 bytes.
  bool bounded = true;
  if (c.stage >= 2) {
    const int64_t quantum = comm->size() * c.align_bytes;
    const int64_t bucket = std::max(quantum, c.bucket_bytes / quantum * quantum);
    // Stage 3 keeps nothing gathered after the step: the buffers are the pool alone.
    bounded = run.memory.buffer_bytes <= detail::kBucketPoolBuffers * bucket;
    EXPECT_TRUE(bounded) << "buffers " << run.memory.buffer_bytes << " bytes, bucket " << bucket;
  }
  EXPECT_TRUE(test::all_ranks(diff <= 1e-6 && bounded));
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int stage : {0, 1, 2, 3}) {
    for (const char* rule : {"adamw", "sgd", "lamb"}) {
      out.push_back({stage, rule, 64, 64});  // 64-byte buckets: most parameters span several
      // 400-byte buckets with 4-byte alignment: at N = 2 fc2.weight (240 elements, after 17)
      // spans three buckets, 83 + 100 + 57 elements, each split between the two ranks.
      out.push_back({stage, rule, 400, 4});
      out.push_back({stage, rule, 1024, 64});  // parameters larger than a bucket, some shared
    }
    out.push_back({stage, "adamw", 64, 64, 4});         // accumulation
    out.push_back({stage, "sgd", 400, 4, 4, 0.05});     // accumulation + clipping
    out.push_back({stage, "lamb", 400, 4, 1, 0.05});    // clipping
  }
  // Stage 3 with the tied embedding as a unit run twice, or shared by two units; head.bias and
  // unused.weight (or unused.weight alone) in no unit.
  for (Embed e : {Embed::RunTwice, Embed::Shared}) {
    for (const char* rule : {"adamw", "sgd", "lamb"}) out.push_back({3, rule, 64, 64, 1, 0.0, e});
    out.push_back({3, "adamw", 400, 4, 4, 0.05, e});  // accumulation + clipping
    out.push_back({3, "lamb", 1024, 64, 4, 0.05, e});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Split, SplitBucketParity, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return case_name(info.param); });

// Stage 3's communication per step with multiply-used units (Note [Stage 3 units] in
// src/engine/engine.cpp): per micro-step, each part is all-gathered once per forward run of a unit
// needing it and once in backward, and everything is reduce-scattered once; the part of
// parameters in no unit is all-gathered once per step (by zero_grad()).
TEST(SplitBucketCommunication, MultiplyUsedUnitsCountEachRun) {
  auto comm = test::world();
  const int64_t quantum = comm->size() * 16;  // 64-byte alignment of floats
  auto padded = [&](int64_t numel) { return detail::round_up(numel, quantum); };
  const int64_t fc1 = padded(kDim * kHidden + kHidden), fc2 = padded(kHidden * kDim + kDim);
  const int64_t embed = padded(kVocab * kDim);
  for (Embed e : {Embed::RunTwice, Embed::Shared}) {
    for (int accumulation : {1, 4}) {
      const Sharded run = train_sharded({3, "adamw", 64, 64, accumulation, 0.0, e}, comm);
      // RunTwice: embed (run twice), fc1, fc2; head.bias + unused.weight in no unit.
      // Shared: embed shared by the lookup and the head; head.bias the head's own part.
      const int64_t root = e == Embed::RunTwice ? padded(kVocab + 5) : padded(5);
      const int64_t head = e == Embed::Shared ? padded(kVocab) : 0;
      const int64_t psi = fc1 + fc2 + embed + head + root;
      const int64_t forward = fc1 + fc2 + 2 * embed + head;
      const int64_t backward = fc1 + fc2 + embed + head;
      const int64_t expected = accumulation * (forward + backward + psi) + root;
      EXPECT_EQ(run.comm_per_step, expected)
          << "accumulation " << accumulation << (e == Embed::Shared ? ", shared" : ", twice");
    }
  }
}

// The layout the three-bucket case relies on (stages 0-2 order: reverse registration).
TEST(SplitBucketLayout, AParameterSpansThreeBucketsAndTwoRanks) {
  const auto l = detail::make_layout({5, kDim, kHidden * kDim, kHidden, kDim * kHidden,
                                      kVocab * kDim},
                                     {0, 0, 0, 0, 0, 0}, /*world=*/2, /*align=*/1,
                                     /*bucket=*/100);
  const int fc2 = 2;
  ASSERT_EQ(l.slots[fc2].piece_count, 3);
  for (const auto* p = l.pieces_begin(fc2); p != l.pieces_end(fc2); ++p) {
    const auto& bl = l.buckets[p->bucket];
    EXPECT_FALSE(detail::intersect({p->offset, p->offset + p->numel}, bl.owned(0)).empty());
    EXPECT_FALSE(detail::intersect({p->offset, p->offset + p->numel}, bl.owned(1)).empty());
  }
}

}  // namespace
}  // namespace shardopt
