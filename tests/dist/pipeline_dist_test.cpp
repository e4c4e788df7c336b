// run_pipeline() over the world (p = world size) against one process running the same m
// micro-batches of gradient accumulation on the whole model: fp32 gradients and losses bitwise
// equal, for every schedule (interleaved at v = 2), on every engine, with one tensor or several
// per boundary and with parameters left undeclared; bad or disagreeing schedules refused on every
// rank; and its trace complete.
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

// Every schedule at p ranks (interleaved at v = 2 from p = 2), 1F1B and interleaved also with m not
// a multiple of p (interleaved in groups of N = p + 1, Note [Micro-batch groups]).
std::vector<Case> cases_for(int p) {
  std::vector<Case> cases{{PipelineScheduleKind::GPipe, 4, 1},
                          {PipelineScheduleKind::OneFOneB, 4, 1},
                          {PipelineScheduleKind::OneFOneB, 2 * p + 1, 1},
                          {PipelineScheduleKind::ZeroBubbleH1, 2 * p, 1}};
  if (p >= 2) {
    cases.push_back({PipelineScheduleKind::Interleaved1F1B, 2 * p, 2});
    cases.push_back({PipelineScheduleKind::Interleaved1F1B, 2 * p + 1, 2});
  }
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

// Each case run with its messages apart and batched (Note [Batched exchanges]: NCCL's way, here on
// MPI and Gloo).
std::vector<std::pair<Case, PipelineRunOptions::Batching>> with_both_batchings(
    const std::vector<Case>& cases) {
  std::vector<std::pair<Case, PipelineRunOptions::Batching>> out;
  for (const Case& c : cases) {
    out.emplace_back(c, PipelineRunOptions::Batching::Never);
    out.emplace_back(c, PipelineRunOptions::Batching::Always);
  }
  return out;
}

// Whether this rank's layers got bitwise the one-process gradients (and the last stage the same
// losses); each difference is reported, named.
bool matches_one_process(const std::vector<Layer>& model, const std::vector<Layer>& reference,
                         const std::vector<int>& mine, const std::vector<at::Tensor>& losses = {},
                         const std::vector<at::Tensor>& reference_losses = {}) {
  bool ok = true;
  for (int l : mine) {
    for (auto [got, want] : {std::pair{model[l].weight, reference[l].weight},
                             std::pair{model[l].bias, reference[l].bias}}) {
      const bool same = got.grad().defined() && at::equal(got.grad(), want.grad());
      EXPECT_TRUE(same) << "layer " << l
                        << (got.grad().defined()
                                ? fmt::format(" max diff {}",
                                              (got.grad() - want.grad()).abs().max().item<float>())
                                : std::string(": no gradient"));
      ok = ok && same;
    }
  }
  for (size_t mb = 0; mb < losses.size(); ++mb) {
    const bool same = at::equal(losses[mb], reference_losses[mb]);
    EXPECT_TRUE(same) << "loss of micro-batch " << mb;
    ok = ok && same;
  }
  return ok;
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
  using Batching = PipelineRunOptions::Batching;
  for (const auto& [c, batching] : with_both_batchings(cases_for(p))) {
    SCOPED_TRACE(fmt::format("{} p={} m={} v={}{}", to_string(c.kind), p, c.m, c.v,
                             batching == Batching::Always ? " batched" : ""));
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
    options.batch_exchanges = batching;
    const auto losses = run_pipeline(schedule, *comm, chunks, data, options);
    ok = matches_one_process(model, reference, mine, losses, reference_losses) && ok;
    EXPECT_EQ(losses.size(), r == schedule.rank_of(stages - 1) ? size_t(c.m) : size_t{0});
  }
  EXPECT_TRUE(test::all_ranks(ok));
}

// Note [Batched exchanges]: a list valid with separate messages that would hang batched (interleaved
// with each message next to its compute, the placement the former pairing ran) is refused by name
// on every rank when batching, and runs with separate messages. pair_exchanges, the option's
// former name, still asks for batching; batch_exchanges, when set, decides.
TEST_P(PipelineParity, BatchingRefusesWhatWouldHang) {
  auto comm = test::communicator(GetParam());
  const int p = comm->size(), r = comm->rank();
  if (p < 2) GTEST_SKIP() << "interleaved needs two ranks";
  PipelineSchedule schedule = compile_schedule(PipelineScheduleKind::Interleaved1F1B, p, 2 * p, 2);
  for (auto& list : schedule.actions) {  // each message next to its compute
    std::vector<Action> adjacent;
    for (const Action& a : list) {
      if (!is_compute(a.type)) continue;
      const bool forward = a.type == ActionType::Forward;
      const int from = forward ? a.stage - 1 : a.stage + 1, to = forward ? a.stage + 1 : a.stage - 1;
      if (from >= 0 && from < schedule.stages()) {
        adjacent.push_back({forward ? ActionType::RecvActivation : ActionType::RecvGrad,
                            a.microbatch, a.chunk, a.stage, from % p});
      }
      adjacent.push_back(a);
      if (to >= 0 && to < schedule.stages()) {
        adjacent.push_back({forward ? ActionType::SendActivation : ActionType::SendGrad,
                            a.microbatch, a.chunk, a.stage, to % p});
      }
    }
    list = adjacent;
  }
  ASSERT_NO_THROW(validate_schedule(schedule));
  auto model = make_model();
  const auto chunks = chunks_of(model, schedule, r);
  PipelineRunOptions options;
  options.activation_shape = {kBatch, kHidden};
  options.pair_exchanges = PipelineRunOptions::Pairing::Always;
  const std::string what =
      test::expect_error([&] { run_pipeline(schedule, *comm, chunks, data, options); },
                         ErrorKind::Unsupported, {"would hang", "deadlocks with batched exchanges"});
  EXPECT_TRUE(test::all_ranks(!what.empty()));
  options.batch_exchanges = PipelineRunOptions::Batching::Never;
  EXPECT_EQ(run_pipeline(schedule, *comm, chunks, data, options).size(),
            r == schedule.rank_of(schedule.stages() - 1) ? size_t(2 * p) : size_t{0});
}

// run_pipeline checks the schedule before any message: an invalid one is the validator's
// InvalidArgument on every rank (all were handed it), never a run that hangs half-way.
TEST_P(PipelineParity, InvalidScheduleRefusedByNameOnEveryRank) {
  auto comm = test::communicator(GetParam());
  const int p = comm->size(), r = comm->rank();
  auto model = make_model();
  PipelineSchedule schedule = compile_schedule(PipelineScheduleKind::OneFOneB, p, 4);
  schedule.actions[0].pop_back();  // rank 0 never runs micro-batch 3's backward
  const auto chunks = chunks_of(model, schedule, r);
  PipelineRunOptions options;
  options.activation_shape = {kBatch, kHidden};
  const std::string what =
      test::expect_error([&] { run_pipeline(schedule, *comm, chunks, data, options); },
                         ErrorKind::InvalidArgument, {"rank 0 must run either", "B3c0"});
  EXPECT_TRUE(test::all_ranks(!what.empty()));
}

// Ranks handed different schedules (another m, another kind) stop with Mismatch on every rank,
// naming which rank got which, before any message; so does a call one rank alone refuses.
TEST_P(PipelineParity, DifferentSchedulesAreAMismatchOnEveryRank) {
  auto comm = test::communicator(GetParam());
  const int p = comm->size(), r = comm->rank();
  if (p < 2) GTEST_SKIP() << "needs two ranks to disagree";
  auto model = make_model();
  PipelineRunOptions options;
  options.activation_shape = {kBatch, kHidden};
  bool ok = true;
  using Kind = PipelineScheduleKind;
  for (const auto& [kind, m, needle] :
       {std::tuple{Kind::OneFOneB, r == 0 ? 4 : 5, std::string("rank 0: 1f1b (p = ") +
                                                      std::to_string(p) + ", m = 4"},
        std::tuple{r == 1 ? Kind::ZeroBubbleH1 : Kind::OneFOneB, 4,
                   std::string("rank 1: zb-h1 (p = ") + std::to_string(p) + ", m = 4"}}) {
    const PipelineSchedule schedule = compile_schedule(kind, p, m);
    const auto chunks = chunks_of(model, schedule, r);
    const std::string what = test::expect_error(
        [&] { run_pipeline(schedule, *comm, chunks, data, options); }, ErrorKind::Mismatch,
        {"were handed different schedules", needle});
    if (r == 0) std::printf("[ message  ] %s\n", what.c_str());
    ok = ok && !what.empty();
  }
  // Rank 1 passes no chunk: it names its error, the others name rank 1.
  const PipelineSchedule schedule = compile_schedule(Kind::OneFOneB, p, 4);
  auto chunks = chunks_of(model, schedule, r);
  if (r == 1) chunks.clear();
  const std::string what = test::expect_error(
      [&] { run_pipeline(schedule, *comm, chunks, data, options); }, ErrorKind::InvalidArgument,
      {r == 1 ? "places v = 1 chunks on each rank, got 0" : "rank 1 refused this run_pipeline"});
  ok = ok && !what.empty();
  EXPECT_TRUE(test::all_ranks(ok));
}

// Note [Owed gradients]: a chunk that forgets parameters in PipelineChunk::parameters (here the
// biases, or all of them) still gets every gradient from ZB-H1's weight pass, bitwise those of
// one process, as 1F1B's one-pass backward gives them.
TEST_P(PipelineParity, ZeroBubbleOwesForgottenParameters) {
  auto comm = test::communicator(GetParam());
  const int p = comm->size(), r = comm->rank();
  const int m = 2 * p;
  bool ok = true;
  for (const bool forget_all : {false, true}) {
    SCOPED_TRACE(forget_all ? "no parameters declared" : "biases not declared");
    auto reference = make_model();
    for (int mb = 0; mb < m; ++mb) loss_of(run_layers(reference, 0, kLayers, data(mb)), mb).backward();
    auto model = make_model();
    const PipelineSchedule schedule = compile_schedule(PipelineScheduleKind::ZeroBubbleH1, p, m);
    std::vector<int> mine;
    std::vector<PipelineChunk> chunks = chunks_of(model, schedule, r, &mine);
    for (auto& chunk : chunks) {
      std::vector<at::Tensor> declared;
      for (size_t i = 0; i < chunk.parameters.size() && !forget_all; i += 2) {
        declared.push_back(chunk.parameters[i]);  // weights only
      }
      chunk.parameters = declared;
    }
    PipelineRunOptions options;
    options.activation_shape = {kBatch, kHidden};
    run_pipeline(schedule, *comm, chunks, data, options);
    ok = matches_one_process(model, reference, mine) && ok;
  }
  EXPECT_TRUE(test::all_ranks(ok));
}

// Several tensors per boundary: each stage passes (hidden [b, h] float, running sum [b] float,
// mask [b] bool), shapes agreed on the first micro-batch (no activation_shape). Gradients flow
// back through both floating tensors; the mask carries none. Every schedule, batched and not,
// bitwise against one process.
struct Carry {
  at::Tensor hidden, sum, mask;
};
Carry carry_layers(const std::vector<Layer>& model, int first, int last, Carry c) {
  for (int l = first; l < last; ++l) {
    c.hidden = at::tanh(at::addmm(model[l].bias, c.hidden, model[l].weight.t())) *
               at::where(c.mask, 1.0, 0.5).to(at::kFloat).unsqueeze(1);
    c.sum = c.sum + c.hidden.sum(1) * 0.01;
  }
  return c;
}
Carry carry_in(const at::Tensor& x) { return {x, x.sum(1), x.select(1, 0) > 0}; }
at::Tensor carry_loss(const Carry& c, int mb) { return loss_of(c.hidden, mb) + c.sum.mean() * 0.1; }

TEST_P(PipelineParity, SeveralTensorsPerBoundary) {
  auto comm = test::communicator(GetParam());
  const int p = comm->size(), r = comm->rank();
  bool ok = true;
  using Batching = PipelineRunOptions::Batching;
  std::vector<Case> cases = cases_for(p);
  // Interleaved with m = p batches a chunk's first receive (its boundary header) with sends.
  if (p >= 2) cases.push_back({PipelineScheduleKind::Interleaved1F1B, p, 2});
  for (const auto& [c, batching] : with_both_batchings(cases)) {
    SCOPED_TRACE(fmt::format("{} p={} m={} v={}{}", to_string(c.kind), p, c.m, c.v,
                             batching == Batching::Always ? " batched" : ""));
    auto reference = make_model();
    std::vector<at::Tensor> reference_losses;
    for (int mb = 0; mb < c.m; ++mb) {
      at::Tensor loss = carry_loss(carry_layers(reference, 0, kLayers, carry_in(data(mb))), mb);
      loss.backward();
      reference_losses.push_back(loss.detach());
    }
    auto model = make_model();
    const PipelineSchedule schedule = compile_schedule(c.kind, p, c.m, c.v);
    const int stages = schedule.stages(), per_stage = kLayers / stages;
    std::vector<PipelineChunk> chunks;
    std::vector<int> mine;
    for (int chunk = 0; chunk < schedule.chunks; ++chunk) {
      const int stage = chunk * p + r, first = stage * per_stage, last = first + per_stage;
      PipelineChunk pc;
      pc.forward_tensors = [&model, first, last, stage, stages](const std::vector<at::Tensor>& in,
                                                                int mb) {
        const Carry out = carry_layers(model, first, last,
                                       stage == 0 ? carry_in(in.at(0)) : Carry{in[0], in[1], in[2]});
        if (stage == stages - 1) return std::vector<at::Tensor>{carry_loss(out, mb)};
        return std::vector<at::Tensor>{out.hidden, out.sum, out.mask};
      };
      for (int l = first; l < last; ++l) {
        pc.parameters.push_back(model[l].weight);
        pc.parameters.push_back(model[l].bias);
        mine.push_back(l);
      }
      chunks.push_back(std::move(pc));
    }
    PipelineRunOptions options;
    options.batch_exchanges = batching;
    const auto losses = run_pipeline(schedule, *comm, chunks, data, options);
    ok = matches_one_process(model, reference, mine, losses, reference_losses) && ok;
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
  using Batching = PipelineRunOptions::Batching;
  for (const auto& [c, batching] : with_both_batchings(cases_for(p))) {
    SCOPED_TRACE(fmt::format("{} p={} m={} v={}{}", to_string(c.kind), p, c.m, c.v,
                             batching == Batching::Always ? " batched" : ""));
    auto model = make_model();
    const PipelineSchedule schedule = compile_schedule(c.kind, p, c.m, c.v);
    const std::vector<PipelineChunk> chunks = chunks_of(model, schedule, r);
    shardopt::PipelineTrace trace;
    PipelineRunOptions options;
    options.activation_shape = {kBatch, kHidden};
    options.trace = &trace;
    options.batch_exchanges = batching;
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
