// Pipeline parallelism composed with ZeRO over the data-parallel group (ZeroOptions::grid):
// a (p, d) grid, each stage's optimizer at stages 0-3 (and hybrid at d = 2) over its d ranks, trains as torch's AdamW on
// the whole model over the global batch (float64: <= 1e-10 after 3 steps), for every schedule, with
// a word embedding tied between the first stage (the lookup) and the last (the decoder), and
// clipping whose norm (reported by every stage) is torch's clip_grad_norm_ of the whole model.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/types.h>  // before clip_grad.h, which does not include it
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "shardopt/estimate.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/parallel_layout.hpp"
#include "shardopt/pipeline.hpp"
#include "shardopt/pipeline_runner.hpp"
#include "support/dist_env.hpp"
#include "support/expect_error.hpp"

namespace shardopt {
namespace {

constexpr int kLayers = 8;  // 1-4 per stage at S = 8, 6, 4, 3, 2 stages
constexpr int64_t kVocab = 12, kHidden = 8, kRows = 2;  // rows per micro-batch
constexpr int kSteps = 3;
constexpr double kMaxNorm = 0.02;  // below every step's norm: every step clips

// The whole model's initial values (the same on every rank).
struct Model {
  at::Tensor embedding;                 // [V, H], tied: lookup on the first stage, decoder last
  std::vector<at::Tensor> weight, bias;  // per layer
};

Model initial_model() {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(17);
  Model m;
  m.embedding = at::randn({kVocab, kHidden}, gen).to(at::kDouble) * 0.5;
  for (int l = 0; l < kLayers; ++l) {
    m.weight.push_back(at::randn({kHidden, kHidden}, gen).to(at::kDouble) * 0.4);
    m.bias.push_back(at::randn({kHidden}, gen).to(at::kDouble) * 0.1);
  }
  return m;
}

// The global batch of step `step`: rows of inputs and targets, d * m * kRows of each.
std::pair<at::Tensor, at::Tensor> global_batch(int step, int64_t rows) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(900 + step);
  return {at::randn({rows, kVocab}, gen).to(at::kDouble),
          at::randn({rows, kVocab}, gen).to(at::kDouble)};
}

at::Tensor embed(const at::Tensor& x, const at::Tensor& e) { return at::tanh(at::mm(x, e)); }
at::Tensor layer(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return at::tanh(at::addmm(b, x, w.t()));
}
at::Tensor decode(const at::Tensor& h, const at::Tensor& e) { return at::mm(h, e.t()); }

// torch's AdamW on the whole model over the global batch: the parameters after kSteps steps and
// each step's gradient norm before clipping.
struct Reference {
  Model after;
  std::vector<double> norms;
};

Reference reference_run(const AdamW& rule, int64_t rows) {
  const Model init = initial_model();
  std::vector<at::Tensor> params{init.embedding.clone().requires_grad_(true)};
  for (int l = 0; l < kLayers; ++l) {
    params.push_back(init.weight[l].clone().requires_grad_(true));
    params.push_back(init.bias[l].clone().requires_grad_(true));
  }
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(rule.lr())
                                      .betas({rule.beta1(), rule.beta2()})
                                      .eps(rule.eps())
                                      .weight_decay(rule.weight_decay()));
  Reference ref;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = global_batch(s, rows);
    opt.zero_grad();
    at::Tensor h = embed(x, params[0]);
    for (int l = 0; l < kLayers; ++l) h = layer(h, params[1 + 2 * l], params[2 + 2 * l]);
    (decode(h, params[0]) - y).pow(2).mean().backward();
    ref.norms.push_back(torch::nn::utils::clip_grad_norm_(params, kMaxNorm));
    opt.step();
  }
  ref.after.embedding = params[0].detach();
  for (int l = 0; l < kLayers; ++l) {
    ref.after.weight.push_back(params[1 + 2 * l].detach());
    ref.after.bias.push_back(params[2 + 2 * l].detach());
  }
  return ref;
}

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() ? (a - b).abs().max().item<double>() : 1e9;
}

struct Case {
  PipelineScheduleKind kind;
  int m, v;
  bool batched = false;  // Note [Batched exchanges] on this engine (PipelineRunOptions::Batching)
};

// The grids (p, d) with p in {2, 4} this world holds.
// The grids a world runs: every p of 2-4 it divides into (p = 3 at 3 ranks), and p = 1 alone (the
// runner with one stage) at one rank.
std::vector<ParallelLayout> layouts(int world) {
  if (world == 1) return {ParallelLayout{1, 1, 1}};
  std::vector<ParallelLayout> out;
  for (int p : {2, 3, 4}) {
    if (world % p == 0) out.push_back(ParallelLayout{1, p, world / p});
  }
  return out;
}

// Micro-batch `mb` of data-parallel rank `dp_rank` in step `step`: its rows of the global batch.
at::Tensor rows_of(const at::Tensor& all, int dp_rank, int m, int mb) {
  return all.narrow(0, (int64_t{dp_rank} * m + mb) * kRows, kRows);
}

DIST_TEST(PipelineZero, GridMatchesTorchAdamWOnTheWholeModel) {
  auto world = test::world();
  const auto grids = layouts(world->size());
  if (grids.empty()) GTEST_SKIP() << "pipelines run at 1-4 ranks";
  const AdamW rule = AdamW(0.01).weight_decay(0.05);
  bool all_ok = true;
  for (const ParallelLayout& layout : grids) {
    const ParallelGroups g = make_parallel_groups(world, layout);
    const int p = layout.pp, d = g.layout.dp;
    std::vector<Case> cases{Case{PipelineScheduleKind::GPipe, 4, 1},
                            Case{PipelineScheduleKind::OneFOneB, 4, 1},
                            Case{PipelineScheduleKind::ZeroBubbleH1, 4, 1}};
    if (p > 1) {
      // Interleaved with its messages apart and batched (NCCL's way), and with m = p + 1, not a
      // multiple of p (one group of N = m: Note [Micro-batch groups]).
      cases.push_back(Case{PipelineScheduleKind::Interleaved1F1B, 2 * p, 2});
      cases.push_back(Case{PipelineScheduleKind::Interleaved1F1B, 2 * p, 2, true});
      cases.push_back(Case{PipelineScheduleKind::Interleaved1F1B, p + 1, 2, true});
    }
    for (const Case& c : cases) {
      const int64_t rows = int64_t{d} * c.m * kRows;
      const Reference ref = reference_run(rule, rows);
      const PipelineSchedule schedule = compile_schedule(c.kind, p, c.m, c.v);
      const int stages = schedule.stages();
      // ZeRO stages 0-3 through the optimizer handshake, stages 2-3 with the reduction deferred
      // and the passes counted by the caller (no handshake: Note [Deferred reduction]), stage 3
      // also released between uses (the default under pipelines holds it: Note [Parts held
      // through a step]) and, with two data-parallel ranks, stage 2 sharded within groups of one
      // rank (hybrid: the shared gradient's pieces come from the first replica alone).
      std::vector<std::tuple<int, int, bool, bool>> zero_runs{
          {0, 0, false, false}, {1, 0, false, false}, {2, 0, false, false},
          {3, 0, false, false}, {3, 0, false, true},  {2, 0, true, false},
          {3, 0, true, false}};
      if (d == 2) zero_runs.push_back({2, 1, false, false});
      for (const auto [zero_stage, shard_group_size, defer, reshard] : zero_runs) {
        SCOPED_TRACE(fmt::format("p={} d={} {} m={} v={}{} ZeRO stage {} shard group {}{}{}", p,
                                 d, to_string(c.kind), c.m, c.v, c.batched ? " batched" : "",
                                 zero_stage, shard_group_size, defer ? " deferred" : "",
                                 reshard ? " resharded" : ""));
        const Model init = initial_model();
        // This rank's chunks' layers and, on the first and the last stage, a copy of the tied
        // embedding (the last stage's starts as zeros: the optimizer copies the first stage's).
        at::Tensor embedding;
        std::vector<int> layers;
        std::vector<at::Tensor> weight, bias;  // by position in `layers`
        ParamGroup group;
        const bool holds_embedding = g.first_stage() || g.last_stage();
        if (holds_embedding) {
          embedding = (g.first_stage() ? init.embedding.clone() : at::zeros_like(init.embedding))
                          .requires_grad_(true);
          mark_pipeline_shared(embedding);
          group.params.push_back({"embedding", embedding});
        }
        int step = 0;
        at::Tensor inputs, targets;  // this step's global batch
        std::vector<PipelineChunk> chunks;
        for (int chunk = 0; chunk < c.v; ++chunk) {
          const int s = chunk * p + g.pp_rank;
          const size_t first = layers.size();
          PipelineChunk pc;
          // Stage s holds layers [s L / S, (s + 1) L / S): even when S divides L, else the later
          // stages one more (S = 3, 6).
          for (int l = s * kLayers / stages; l < (s + 1) * kLayers / stages; ++l) {
            layers.push_back(l);
            weight.push_back(init.weight[l].clone().requires_grad_(true));
            bias.push_back(init.bias[l].clone().requires_grad_(true));
            group.params.push_back({fmt::format("layer{}.weight", l), weight.back()});
            group.params.push_back({fmt::format("layer{}.bias", l), bias.back()});
            pc.parameters.push_back(weight.back());
            pc.parameters.push_back(bias.back());
          }
          if (s == 0 || s == stages - 1) pc.parameters.push_back(embedding);
          const size_t last = layers.size();
          pc.forward = [&, first, last, s](const at::Tensor& input, int mb) {
            at::Tensor h = s == 0 ? embed(input, embedding) : input;
            for (size_t i = first; i < last; ++i) h = layer(h, weight[i], bias[i]);
            if (s != stages - 1) return h;
            // The micro-batch's share of the global mean: the m micro-batches add up and the
            // optimizer averages over the d data-parallel ranks.
            const at::Tensor y = rows_of(targets, g.dp_rank, c.m, mb);
            return (decode(h, embedding) - y).pow(2).mean() / c.m;
          };
          chunks.push_back(std::move(pc));
        }
        ZeroOptions zo;
        zo.stage = stage_from_int(zero_stage);
        zo.shard_group_size = shard_group_size;
        zo.defer_reduction = defer;
        zo.bucket_bytes = 512;
        zo.unit_policy.persist_below = 0;  // stage 3: gathered on use
        zo.timeout = std::chrono::seconds(60);
        // The deferred runs go without the handshake: the caller counts the passes.
        if (defer) zo.grad_accumulation_steps = c.m * c.v;
        zo.max_grad_norm = kMaxNorm;
        zo.grid = g;
        if (reshard) zo.reshard_between_uses = true;
        DistributedOptimizer opt({group}, rule, g.dp, zo);
        PipelineRunOptions run;
        run.activation_shape = {kRows, kHidden};
        run.activation_dtype = at::kDouble;
        run.batch_exchanges = c.batched ? PipelineRunOptions::Batching::Always
                                        : PipelineRunOptions::Batching::Never;
        // The handshake (Note [Pipeline handshake]): one backward pass per chunk and
        // micro-batch, the weight pass as one, each chunk's buckets reduced after its last.
        if (defer) {
          run.weight_pass = [&](const std::function<void()>& pass) { opt.as_one_backward(pass); };
        } else {
          run.optimizer = &opt;
        }
        double norm_error = 0.0;
        bool clipped = true;
        int64_t elements = 0;  // the last step's all-gathered parameter elements
        for (step = 0; step < kSteps; ++step) {
          std::tie(inputs, targets) = global_batch(step, rows);
          opt.zero_grad();
          run_pipeline(schedule, *g.pp, chunks,
                       [&](int mb) { return rows_of(inputs, g.dp_rank, c.m, mb); }, run);
          opt.step();
          elements = opt.last_step().gather_elements;
          clipped = clipped && opt.last_step().clipped;
          norm_error =
              std::max(norm_error, std::abs(opt.last_step().grad_norm / ref.norms[step] - 1));
        }
        bool estimated = true;
        if (shard_group_size == 0) {
          // The estimator knows the pipeline's defaults (Note [Pipelines decide two defaults]):
          // the kept gradients exactly, the buffers as a bound.
          estimate::Options o;
          o.params = opt.padded_numel();
          o.world = d;
          o.stage = zero_stage;
          o.params_on_host = true;
          o.bucket_bytes = zo.bucket_bytes;
          o.defer_reduction = defer;
          o.pipeline_ranks = p;
          o.reshard_between_uses = zo.reshard_between_uses;
          const estimate::Estimate e = estimate::model_states(o);
          const MemoryReport mem = opt.memory();
          const int64_t wide = 2;  // the estimator counts fp32 elements, these are float64
          EXPECT_EQ(mem.grad_bytes, wide * e.device.grads);
          EXPECT_LE(mem.buffer_bytes, wide * e.device.buffers);
          estimated = mem.grad_bytes == wide * e.device.grads &&
                      mem.buffer_bytes <= wide * e.device.buffers;
        }
        opt.gather_full_parameters();
        double diff = holds_embedding ? max_diff(embedding, ref.after.embedding) : 0.0;
        for (size_t i = 0; i < layers.size(); ++i) {
          diff = std::max({diff, max_diff(weight[i], ref.after.weight[layers[i]]),
                           max_diff(bias[i], ref.after.bias[layers[i]])});
        }
        EXPECT_LE(diff, 1e-10);
        EXPECT_LE(norm_error, 1e-9) << "the grid's gradient norm is not the whole model's";
        EXPECT_TRUE(clipped);
        bool counted = true;
        if (zero_stage == 3) {
          // Held (the default under pipelines only), each parameter of the layout is gathered
          // once a step; released between uses, once per use.
          const bool held = p > 1 && !reshard;
          counted = held ? elements == opt.padded_numel() : elements > opt.padded_numel();
          EXPECT_TRUE(counted) << elements << " elements all-gathered in a step, the layout holds "
                               << opt.padded_numel() << (held ? " (held)" : "");
        }
        all_ok = all_ok && diff <= 1e-10 && norm_error <= 1e-9 && clipped && counted && estimated;
      }
    }
  }
  EXPECT_TRUE(test::all_ranks(all_ok));
}

// The gradient elements one step of `kind` at (p = 2, d = 2) sends into the reductions on this
// rank, at ZeRO `zero_stage` (the last of two steps).
int64_t reduced_elements(const ParallelGroups& g, PipelineScheduleKind kind, int m, int v,
                         int zero_stage) {
  const int p = g.layout.pp, d = g.layout.dp;
  const PipelineSchedule schedule = compile_schedule(kind, p, m, v);
  const int stages = schedule.stages();
  const Model init = initial_model();
  ParamGroup group;
  std::vector<at::Tensor> weight, bias;
  weight.reserve(kLayers);
  bias.reserve(kLayers);
  std::vector<PipelineChunk> chunks;
  at::Tensor inputs, targets;
  for (int chunk = 0; chunk < v; ++chunk) {
    const int s = chunk * p + g.pp_rank;
    const size_t first = weight.size();
    PipelineChunk pc;
    for (int l = s * kLayers / stages; l < (s + 1) * kLayers / stages; ++l) {
      weight.push_back(init.weight[l].clone().requires_grad_(true));
      bias.push_back(init.bias[l].clone().requires_grad_(true));
      group.params.push_back({fmt::format("layer{}.weight", l), weight.back()});
      group.params.push_back({fmt::format("layer{}.bias", l), bias.back()});
      pc.parameters.push_back(weight.back());
      pc.parameters.push_back(bias.back());
    }
    const size_t last = weight.size();
    pc.forward = [&, first, last, s](const at::Tensor& input, int mb) {
      at::Tensor h = s == 0 ? at::narrow(input, 1, 0, kHidden) : input;
      for (size_t i = first; i < last; ++i) h = layer(h, weight[i], bias[i]);
      if (s != stages - 1) return h;
      return (h - at::narrow(rows_of(targets, g.dp_rank, m, mb), 1, 0, kHidden)).pow(2).mean();
    };
    chunks.push_back(std::move(pc));
  }
  ZeroOptions zo;
  zo.stage = stage_from_int(zero_stage);
  zo.bucket_bytes = 512;
  zo.timeout = std::chrono::seconds(60);
  zo.grid = g;
  DistributedOptimizer opt({group}, AdamW(0.01), g.dp, zo);
  PipelineRunOptions run;
  run.activation_shape = {kRows, kHidden};
  run.activation_dtype = at::kDouble;
  run.optimizer = &opt;  // v*m passes, the weight pass as one, each chunk's last pass
  for (int step = 0; step < 2; ++step) {
    std::tie(inputs, targets) = global_batch(step, int64_t{d} * m * kRows);
    run_pipeline(schedule, *g.pp, chunks,
                 [&](int mb) { return rows_of(inputs, g.dp_rank, m, mb); }, run);
    opt.step();
  }
  return opt.last_step().reduce_elements;
}

// Each bucket is reduced once a step whatever the stage and the schedule (Note [Pipeline
// handshake] in src/pipeline/runner.cpp), so stage 2 sends stage 1's gradient elements. Before the
// handshake, m = 8: 16x interleaved (a bucket of zeros for the chunk a pass did not run), 8x 1F1B
// and ZB-H1.
DIST_TEST(PipelineZero, Stage2SendsStage1GradientElements) {
  auto world = test::world();
  if (world->size() != 4) GTEST_SKIP() << "counted at p = 2, d = 2";
  const ParallelGroups g = make_parallel_groups(world, ParallelLayout{1, 2, 2});
  bool all_ok = true;
  for (const auto& [kind, v] : {std::pair{PipelineScheduleKind::Interleaved1F1B, 2},
                                std::pair{PipelineScheduleKind::OneFOneB, 1},
                                std::pair{PipelineScheduleKind::ZeroBubbleH1, 1}}) {
    const int64_t one = reduced_elements(g, kind, 8, v, 1);
    const int64_t two = reduced_elements(g, kind, 8, v, 2);
    EXPECT_EQ(two, one) << to_string(kind) << " m = 8 v = " << v << ": stage 2 sends "
                        << static_cast<double>(two) / static_cast<double>(one)
                        << "x stage 1's gradient elements";
    all_ok = all_ok && one > 0 && two == one;
    if (world->rank() == 0) {
      fmt::print("{} m = 8 v = {}: stage 1 sends {}, stage 2 {} gradient elements a step\n",
                 to_string(kind), v, one, two);
    }
  }
  EXPECT_TRUE(test::all_ranks(all_ok));
}

// What the runner tells an optimizer (Note [Pipeline handshake]): begin_pipeline(v, m) once, then
// per chunk m passes, the last of which alone says so, then end_pipeline() once.
class RecordingOptimizer final : public PipelineOptimizer {
 public:
  void begin_pipeline(int chunks, int microbatches) override {
    calls.push_back(fmt::format("begin {} {}", chunks, microbatches));
  }
  void chunk_backward(int chunk, bool last, const std::function<void()>& pass) override {
    pass();
    calls.push_back(fmt::format("pass {}{}", chunk, last ? " last" : ""));
  }
  void end_pipeline() override { calls.push_back("end"); }
  std::vector<std::string> calls;
};

DIST_TEST(PipelineZero, HandshakeAnnouncesEachChunksLastPass) {
  auto world = test::world();
  const int p = world->size();
  bool all_ok = true;
  for (const auto& [kind, v] : {std::pair{PipelineScheduleKind::GPipe, 1},
                                std::pair{PipelineScheduleKind::OneFOneB, 1},
                                std::pair{PipelineScheduleKind::ZeroBubbleH1, 1},
                                std::pair{PipelineScheduleKind::Interleaved1F1B, 2}}) {
    if (kind == PipelineScheduleKind::Interleaved1F1B && p < 2) continue;
    const int m = 2 * p;
    const PipelineSchedule schedule = compile_schedule(kind, p, m, v);
    std::vector<PipelineChunk> chunks(v);
    std::vector<at::Tensor> weights;
    for (int c = 0; c < v; ++c) {
      weights.push_back(at::ones({kHidden, kHidden}, at::kDouble).requires_grad_(true));
      const at::Tensor w = weights.back();
      const bool last_stage = c * p + world->rank() == schedule.stages() - 1;
      chunks[c].parameters = {w};
      chunks[c].forward = [w, last_stage](const at::Tensor& x, int) {
        const at::Tensor h = at::tanh(at::mm(x, w));
        return last_stage ? h.sum() : h;
      };
    }
    RecordingOptimizer rec;
    PipelineRunOptions run;
    run.activation_shape = {kRows, kHidden};
    run.activation_dtype = at::kDouble;
    run.optimizer = &rec;
    run_pipeline(schedule, *world, chunks,
                 [](int) { return at::ones({kRows, kHidden}, at::kDouble); }, run);
    // The expected sequence: the passes in the order of this rank's list.
    std::vector<std::string> expected{fmt::format("begin {} {}", v, m)};
    const auto& list = schedule.actions[world->rank()];
    std::vector<int> left(v, m);
    for (const Action& a : list) {
      if (a.type != ActionType::Backward && a.type != ActionType::BackwardWeight) continue;
      expected.push_back(fmt::format("pass {}{}", a.chunk, --left[a.chunk] == 0 ? " last" : ""));
    }
    expected.push_back("end");
    EXPECT_EQ(rec.calls, expected) << to_string(kind);
    EXPECT_EQ(static_cast<int>(expected.size()), v * m + 2) << to_string(kind);
    all_ok = all_ok && rec.calls == expected && static_cast<int>(expected.size()) == v * m + 2;
  }
  EXPECT_TRUE(test::all_ranks(all_ok));
}

// Stages marking different tied tensors, a grid cut apart, and a communicator that is not the
// grid's data-parallel group: clear errors on every rank, no hang. Marked alike, the last stage's
// copy starts as the first stage's.
TEST(PipelineZero, SharedMarksAndClearErrors) {
  auto world = test::world();
  if (world->size() != 2) GTEST_SKIP() << "checked at p = 2";
  const ParallelGroups g = make_parallel_groups(world, ParallelLayout{1, 2, 1});
  const auto model = [](bool mark_embedding, bool mark_w) {
    at::Tensor e = at::ones({4, 3}).requires_grad_(true);
    at::Tensor w = at::ones({3, 3}).requires_grad_(true);
    if (mark_embedding) mark_pipeline_shared(e);
    if (mark_w) mark_pipeline_shared(w);
    ParamGroup group;
    group.params = {{"embedding", e}, {"w", w}};
    return group;
  };
  ZeroOptions zo;
  zo.timeout = std::chrono::seconds(60);
  zo.grid = g;
  const auto unequal = model(g.first_stage(), g.last_stage());
  test::expect_error([&] { DistributedOptimizer({unequal}, AdamW(0.01), g.dp, zo); },
                     ErrorKind::InvalidArgument,
                     {"mark_pipeline_shared differ between the first and the last"});
  test::expect_error([&] { DistributedOptimizer({unequal}, AdamW(0.01), world, zo); },
                     ErrorKind::InvalidArgument,
                     {"communicator has 2 rank(s) but ZeroOptions::grid's data-parallel group "
                      "has 1"});
  zo.grid.pp = nullptr;
  test::expect_error([&] { DistributedOptimizer({unequal}, AdamW(0.01), g.dp, zo); },
                     ErrorKind::InvalidArgument, {"grid.embedding is set but grid.pp is null"});
  zo.grid = g;
  const auto alike = model(true, false);
  const at::Tensor& e = alike.params[0].tensor;
  if (g.last_stage()) e.detach().fill_(5.0);
  DistributedOptimizer opt({alike}, AdamW(0.01), g.dp, zo);
  EXPECT_TRUE(test::all_ranks(at::equal(e, at::ones({4, 3}))));
}

}  // namespace
}  // namespace shardopt
