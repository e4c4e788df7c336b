// run_pipeline() over the world (p = world size) against one process running the same m
// micro-batches of gradient accumulation on the whole model: fp32 gradients and losses bitwise
// equal, for every schedule (interleaved at v = 2), on every engine; and its trace complete.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "shardopt/comm.hpp"
#include "shardopt/pipeline.hpp"
#include "shardopt/pipeline_runner.hpp"
#include "support/dist_env.hpp"
#include "support/expect_error.hpp"

namespace shardopt {
namespace {

constexpr int kLayers = 24;  // divides into 2, 3, 4, 6 and 8 stages
constexpr int64_t kHidden = 8;
constexpr int64_t kBatch = 4;  // sequences per micro-batch

struct Layer {
  at::Tensor weight, bias;
};

// Leaf parameters with fixed values, the same on every rank and every call.
std::vector<Layer> make_model() {
  std::vector<Layer> layers;
  for (int l = 0; l < kLayers; ++l) {
    const double f = 0.37 * (l + 1);
    layers.push_back(
        {(at::sin(at::arange(kHidden * kHidden, at::kFloat) * f) * 0.6).reshape({kHidden, kHidden})
             .requires_grad_(true),
         (at::cos(at::arange(kHidden, at::kFloat) * f) * 0.1).requires_grad_(true)});
  }
  return layers;
}

at::Tensor data(int mb) {
  const at::Tensor i = at::arange(kBatch * kHidden, at::kFloat);
  return at::cos(i * (0.11 * (mb + 1))).reshape({kBatch, kHidden});
}
at::Tensor target(int mb) {
  const at::Tensor i = at::arange(kBatch * kHidden, at::kFloat);
  return at::sin(i * (0.23 * (mb + 1))).reshape({kBatch, kHidden});
}

at::Tensor run_layers(const std::vector<Layer>& model, int first, int last, at::Tensor x) {
  for (int l = first; l < last; ++l) x = at::tanh(at::addmm(model[l].bias, x, model[l].weight.t()));
  return x;
}

at::Tensor loss_of(const at::Tensor& out, int mb) { return (out - target(mb)).pow(2).mean(); }

struct Case {
  PipelineScheduleKind kind;
  int m, v;
};

// Every schedule at p ranks (interleaved at v = 2 from p = 2), 1F1B also with m not a multiple of p.
std::vector<Case> cases_for(int p) {
  std::vector<Case> cases{{PipelineScheduleKind::GPipe, 4, 1},
                          {PipelineScheduleKind::OneFOneB, 4, 1},
                          {PipelineScheduleKind::OneFOneB, 2 * p + 1, 1},
                          {PipelineScheduleKind::ZeroBubbleH1, 2 * p, 1}};
  if (p >= 2) cases.push_back({PipelineScheduleKind::Interleaved1F1B, 2 * p, 2});
  return cases;
}

// Rank r's chunks of `model` (which must outlive them) for `schedule`; `layers` gets their
// layers' indices.
std::vector<PipelineChunk> chunks_of(const std::vector<Layer>& model,
                                     const PipelineSchedule& schedule, int r,
                                     std::vector<int>* layers = nullptr) {
  const int stages = schedule.stages(), per_stage = kLayers / stages;
  std::vector<PipelineChunk> chunks;
  for (int chunk = 0; chunk < schedule.chunks; ++chunk) {
    const int stage = chunk * schedule.ranks + r;
    const int first = stage * per_stage, last = first + per_stage;
    PipelineChunk pc;
    pc.forward = [&model, first, last, stage, stages](const at::Tensor& x, int mb) {
      at::Tensor out = run_layers(model, first, last, x);
      return stage == stages - 1 ? loss_of(out, mb) : out;
    };
    for (int l = first; l < last; ++l) {
      pc.parameters.push_back(model[l].weight);
      pc.parameters.push_back(model[l].bias);
      if (layers) layers->push_back(l);
    }
    chunks.push_back(std::move(pc));
  }
  return chunks;
}

// Each case run with its sends and receives apart and paired (Note [Paired exchanges]: NCCL's
// way, here on MPI and Gloo).
std::vector<std::pair<Case, PipelineRunOptions::Pairing>> with_both_pairings(
    const std::vector<Case>& cases) {
  std::vector<std::pair<Case, PipelineRunOptions::Pairing>> out;
  for (const Case& c : cases) {
    out.emplace_back(c, PipelineRunOptions::Pairing::Never);
    out.emplace_back(c, PipelineRunOptions::Pairing::Always);
  }
  return out;
}

class PipelineParity : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!test::communicator(GetParam())) GTEST_SKIP() << test::not_built(GetParam());
  }
};

TEST_P(PipelineParity, GradientsBitwiseEqualOneProcessAccumulating) {
  auto comm = test::communicator(GetParam());
  const int p = comm->size(), r = comm->rank();
  bool ok = true;
  using Pairing = PipelineRunOptions::Pairing;
  for (const auto& [c, pairing] : with_both_pairings(cases_for(p))) {
    SCOPED_TRACE(fmt::format("{} p={} m={} v={}{}", to_string(c.kind), p, c.m, c.v,
                             pairing == Pairing::Always ? " paired" : ""));
    // One process: m micro-batches of gradient accumulation on the whole model.
    auto reference = make_model();
    std::vector<at::Tensor> reference_losses;
    for (int mb = 0; mb < c.m; ++mb) {
      at::Tensor loss = loss_of(run_layers(reference, 0, kLayers, data(mb)), mb);
      loss.backward();
      reference_losses.push_back(loss.detach());
    }
    // The pipeline: this rank's chunks of a fresh copy.
    auto model = make_model();
    const PipelineSchedule schedule = compile_schedule(c.kind, p, c.m, c.v);
    const int stages = schedule.stages();
    std::vector<int> mine;  // the layers this rank holds
    const std::vector<PipelineChunk> chunks = chunks_of(model, schedule, r, &mine);
    PipelineRunOptions options;
    options.activation_shape = {kBatch, kHidden};
    options.pair_exchanges = pairing;
    if (pairing == Pairing::Always && !paired_deadlock(schedule).empty()) {
      // Refused on every rank before any message (Note [Paired exchanges]), rather than a hang.
      test::expect_error([&] { run_pipeline(schedule, *comm, chunks, data, options); },
                         ErrorKind::Unsupported, {"would hang", "deadlocks with paired exchanges"});
      continue;
    }
    const auto losses = run_pipeline(schedule, *comm, chunks, data, options);

    for (int l : mine) {
      for (auto [got, want] : {std::pair{model[l].weight, reference[l].weight},
                               std::pair{model[l].bias, reference[l].bias}}) {
        const bool same = got.grad().defined() && at::equal(got.grad(), want.grad());
        EXPECT_TRUE(same) << "layer " << l << " max diff "
                          << (got.grad().defined()
                                  ? (got.grad() - want.grad()).abs().max().item<float>()
                                  : -1.f);
        ok = ok && same;
      }
    }
    for (size_t mb = 0; mb < losses.size(); ++mb) {
      const bool same = at::equal(losses[mb], reference_losses[mb]);
      EXPECT_TRUE(same) << "loss of micro-batch " << mb;
      ok = ok && same;
    }
    EXPECT_EQ(losses.size(), r == schedule.rank_of(stages - 1) ? size_t(c.m) : size_t{0});
  }
  EXPECT_TRUE(test::all_ranks(ok));
}

INSTANTIATE_TEST_SUITE_P(Engines, PipelineParity, ::testing::ValuesIn(test::backends()),
                         [](const auto& info) { return info.param; });

// PipelineRunOptions::trace holds one timing per action of this rank's list, in the list's order:
// each ends no earlier than it starts and starts no earlier than the previous one ended (one
// steady clock), so no action is missing, doubled or out of place. A second call overwrites it.
// Orders only, no durations: nothing here depends on how fast the machine is.
using PipelineTrace = PipelineParity;

TEST_P(PipelineTrace, EveryActionRecordedOnceInOrder) {
  auto comm = test::communicator(GetParam());
  const int p = comm->size(), r = comm->rank();
  bool ok = true;
  using Pairing = PipelineRunOptions::Pairing;
  for (const auto& [c, pairing] : with_both_pairings(cases_for(p))) {
    SCOPED_TRACE(fmt::format("{} p={} m={} v={}{}", to_string(c.kind), p, c.m, c.v,
                             pairing == Pairing::Always ? " paired" : ""));
    auto model = make_model();
    const PipelineSchedule schedule = compile_schedule(c.kind, p, c.m, c.v);
    const std::vector<PipelineChunk> chunks = chunks_of(model, schedule, r);
    shardopt::PipelineTrace trace;
    PipelineRunOptions options;
    options.activation_shape = {kBatch, kHidden};
    options.trace = &trace;
    for (int call = 0; call < 2; ++call) {
      run_pipeline(schedule, *comm, chunks, data, options);
      const auto& list = schedule.actions[r];
      const bool complete = trace.actions.size() == list.size();
      EXPECT_TRUE(complete) << trace.actions.size() << " timings for " << list.size()
                            << " actions";
      ok = ok && complete;
      for (size_t i = 0; complete && i < list.size(); ++i) {
        const auto& t = trace.actions[i];
        const bool ordered = t.start_ns > 0 && t.end_ns >= t.start_ns && t.cpu_ns >= 0 &&
                             (i == 0 || t.start_ns >= trace.actions[i - 1].end_ns);
        EXPECT_TRUE(ordered) << "action " << i << " (" << to_string(list[i]) << "): start "
                             << t.start_ns << ", end " << t.end_ns << ", cpu " << t.cpu_ns;
        ok = ok && ordered;
      }
    }
  }
  EXPECT_TRUE(test::all_ranks(ok));
}

INSTANTIATE_TEST_SUITE_P(Engines, PipelineTrace, ::testing::ValuesIn(test::backends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace shardopt
