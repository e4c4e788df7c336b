// Stages 0-3 against a single-process torch optimizer on the whole global batch: each rank feeds
// its slice, and after 10 steps every parameter must match within 1e-6 (fp32). The model has a
// tied weight, a frozen parameter, one that never gets a gradient, a 1-element group (fewer
// elements than ranks) and two stage-3 units (fc1, fc2; the rest is in no unit).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/types.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <limits>
#include <map>

#include "shardopt/detail/partition.hpp"
#include "shardopt/detail/plan.hpp"
#include "shardopt/error.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/units.hpp"
#include "support/counting_communicator.hpp"
#include "support/dist_env.hpp"
#include "support/expect_error.hpp"
#include "support/reference_lamb.hpp"
#include "support/reference_loop.hpp"
#include "support/tiny_net.hpp"

namespace shardopt {
namespace {

using test::batch;
using test::kBatch;
using test::kDim;
using test::kSteps;
using test::kVocab;
using test::make_rule;
using test::max_abs_diff;
using test::TinyNet;

struct Case {
  int stage;
  std::string rule;
  int accumulation = 1;
  double clip = 0.0;
  bool split_groups = false;
  bool overlap = true;
  int64_t bucket_bytes = 64;  // small: most parameters get buckets of their own
  std::string backend = "mpi";
  bool offload = false;
  Precision precision = Precision::FP32;
  bool reduce_in_fp32 = true;
  bool fused = true;  // the fused kernels where they exist; false: torch's ops
  int shard_group = 0;  // > 0: hybrid sharding over groups of this many ranks
  // Accumulation in torch's style: (loss / k).backward() instead of opt.backward(loss).
  bool torch_style = false;
  // Stage 3 without declared units: units derived from the names, gathered on first use.
  bool auto_units = false;
  // With auto_units: the small groups persist (Note [Persistent parameters] in
  // src/engine/part_store.cpp), within half of the model, instead of none.
  bool persist = false;
  // ZeroOptions::defer_reduction (Note [Deferred reduction]).
  bool defer = false;
};

std::string case_name(const Case& c) {
  return fmt::format("stage{}_{}{}{}{}{}_b{}_{}{}{}{}", c.stage, c.rule,
                     c.accumulation > 1 ? fmt::format("_accum{}", c.accumulation) : "",
                     c.clip > 0 ? "_clip" : "", c.split_groups ? "_groups" : "",
                     c.overlap ? "" : "_sync", c.bucket_bytes, c.backend,
                     c.offload ? "_offload" : "",
                     c.precision != Precision::FP32 ? std::string("_") + to_string(c.precision) : "",
                     c.reduce_in_fp32 ? "" : "_lowreduce") + (c.fused ? "" : "_unfused") +
         (c.shard_group > 0 ? fmt::format("_hybrid{}", c.shard_group) : "") +
        (c.torch_style ? "_torchstyle" : "") + (c.auto_units ? "_autounits" : "") +
        (c.persist ? "_persist" : "") + (c.defer ? "_deferred" : "");
}


// The trainable, deduplicated parameters of each group, with the group's rule.
std::vector<std::pair<std::vector<at::Tensor>, Rule>> reference_groups(const Case& c, TinyNet& net) {
  std::vector<std::pair<std::vector<at::Tensor>, Rule>> out;
  for (auto& g : net.groups(c.split_groups)) {
    std::vector<at::Tensor> ps;
    for (auto& np : g.params) {
      if (np.tensor.requires_grad() && np.name != "decoder.weight") ps.push_back(np.tensor);
    }
    Rule r = make_rule(c.rule);
    if (g.lr) set_rule_lr(r, *g.lr);
    if (g.weight_decay) set_rule_weight_decay(r, *g.weight_decay);
    out.emplace_back(ps, r);
  }
  return out;
}

template <typename Optim, typename Options, typename Convert>
std::unique_ptr<torch::optim::Optimizer> build(const std::vector<std::pair<std::vector<at::Tensor>, Rule>>& spec,
                                               Convert convert) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (auto& [ps, rule] : spec) groups.emplace_back(ps, std::make_unique<Options>(convert(rule)));
  auto optim = std::make_unique<Optim>(std::move(groups), convert(spec.front().second));
  // Recent torch merges group options with the defaults where a value equals the constructor
  // default (momentum 0 for SGD would take the defaults' momentum): each group keeps its own.
  for (size_t g = 0; g < spec.size(); ++g) {
    optim->param_groups()[g].set_options(std::make_unique<Options>(convert(spec[g].second)));
  }
  return optim;
}

// torch's optimizer for the same rule and groups; LAMB has no torch counterpart (lamb_step).
std::unique_ptr<torch::optim::Optimizer> torch_optimizer(const Case& c, TinyNet& net) {
  namespace o = torch::optim;
  auto spec = reference_groups(c, net);
  if (c.rule == "adamw") {
    return build<o::AdamW, o::AdamWOptions>(spec, [](const Rule& r) {
      auto& a = std::get<AdamW>(r);
      return o::AdamWOptions(a.lr()).betas({a.beta1(), a.beta2()}).eps(a.eps())
          .weight_decay(a.weight_decay()).amsgrad(a.amsgrad());
    });
  }
  if (c.rule == "adam") {
    return build<o::Adam, o::AdamOptions>(spec, [](const Rule& r) {
      auto& a = std::get<Adam>(r);
      return o::AdamOptions(a.lr()).betas({a.beta1(), a.beta2()}).eps(a.eps())
          .weight_decay(a.weight_decay()).amsgrad(a.amsgrad());
    });
  }
  if (c.rule == "sgd" || c.rule == "nesterov") {
    return build<o::SGD, o::SGDOptions>(spec, [](const Rule& r) {
      auto& a = std::get<SGD>(r);
      return o::SGDOptions(a.lr()).momentum(a.momentum()).dampening(a.dampening())
          .weight_decay(a.weight_decay()).nesterov(a.nesterov());
    });
  }
  if (c.rule == "adagrad") {
    return build<o::Adagrad, o::AdagradOptions>(spec, [](const Rule& r) {
      auto& a = std::get<Adagrad>(r);
      return o::AdagradOptions(a.lr()).lr_decay(a.lr_decay()).weight_decay(a.weight_decay())
          .initial_accumulator_value(a.initial_accumulator_value()).eps(a.eps());
    });
  }
  if (c.rule == "rmsprop") {
    return build<o::RMSprop, o::RMSpropOptions>(spec, [](const Rule& r) {
      auto& a = std::get<RMSprop>(r);
      return o::RMSpropOptions(a.lr()).alpha(a.alpha()).eps(a.eps())
          .weight_decay(a.weight_decay()).momentum(a.momentum()).centered(a.centered());
    });
  }
  return nullptr;
}

// Single-process LAMB, per whole tensor: the definition sharded LAMB must reproduce.
struct ReferenceLamb {
  test::LambMoments moments;
  int64_t step = 0;
  void operator()(const std::vector<std::pair<std::vector<at::Tensor>, Rule>>& spec) {
    ++step;
    for (auto& [ps, rule] : spec) test::reference_lamb_step(ps, std::get<Lamb>(rule), step, moments);
  }
};

// Trains the reference on whole global batches (all micro-batches at once).
std::map<std::string, at::Tensor> train_reference(const Case& c) {
  TinyNet net;
  auto optimizer = torch_optimizer(c, net);
  auto spec = reference_groups(c, net);
  ReferenceLamb lamb;
  std::vector<at::Tensor> all;
  for (auto& [ps, r] : spec) all.insert(all.end(), ps.begin(), ps.end());
  test::train_reference_loop(
      all, kSteps, c.accumulation, c.clip,
      [&](const at::Tensor& x, const at::Tensor& y) { return net.loss(x, y); }, batch,
      [&](int64_t) {
        if (optimizer) optimizer->step(); else lamb(spec);
      });
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : net.named) out[name] = t.detach().clone();
  return out;
}

struct ShardedRun {
  std::map<std::string, at::Tensor> params;
  MemoryReport memory;
  int64_t padded_numel = 0;
  int64_t comm_per_step = -1;  // elements the counting communicator saw in the last step
  int64_t reported_comm = -1;  // what the optimizer's last_step() says it sent
  at::ScalarType dtype = at::kFloat;  // of the model's parameters after construction
};

ShardedRun train_sharded(const Case& c, CommunicatorPtr comm) {
  TinyNet net;
  ZeroOptions zo;
  zo.stage = stage_from_int(c.stage);
  zo.grad_accumulation_steps = c.accumulation;
  zo.max_grad_norm = c.clip;
  zo.overlap_comm = c.overlap;
  zo.bucket_bytes = c.bucket_bytes;
  zo.timeout = std::chrono::seconds(60);
  zo.units = net.units;  // used by stage 3, ignored by the others
  if (c.auto_units) {
    zo.units = nullptr;  // net.loss's units->run calls then just call their functions
    zo.unit_policy.persist_below = c.persist ? int64_t{1} << 40 : 0;
    zo.unit_policy.persist_share = 0.5;
  }
  zo.offload = c.offload ? Offload::CPU : Offload::None;
  zo.precision = c.precision;
  zo.reduce_in_fp32 = c.reduce_in_fp32;
  zo.fused_update = c.fused;
  zo.loss_scale.initial_scale = 1024;
  net.upcast = c.precision != Precision::FP32;
  auto counting = std::make_shared<test::CountingCommunicator>(comm);
  zo.shard_group_size = c.shard_group;
  zo.defer_reduction = c.defer;
  DistributedOptimizer opt(net.groups(c.split_groups), make_rule(c.rule), counting, zo);
  const int64_t per_rank = kBatch / comm->size();
  ShardedRun run;
  for (int64_t s = 0; s < kSteps; ++s) {
    // Counted by the wrapper around the engine over the whole step: reductions start in backward.
    const int64_t before = counting->traffic().elements;
    opt.zero_grad();
    for (int m = 0; m < c.accumulation; ++m) {
      auto [x, y] = batch(s, m);
      at::Tensor loss = net.loss(x.narrow(0, comm->rank() * per_rank, per_rank),
                                 y.narrow(0, comm->rank() * per_rank, per_rank));
      if (c.torch_style) {
        (loss / c.accumulation).backward();
      } else {
        opt.backward(loss);
      }
    }
    opt.step();
    run.comm_per_step = counting->traffic().elements - before;
    run.reported_comm = opt.last_step().comm_elements;
  }
  run.memory = opt.memory();
  opt.gather_full_parameters();  // stage 3: units hold no storage between steps
  for (auto& [name, t] : net.named) run.params[name] = t.detach().to(at::kFloat, false, true);
  run.dtype = net.by_name["fc1.weight"].scalar_type();
  run.padded_numel = opt.padded_numel();
  return run;
}

class StageParity : public ::testing::TestWithParam<Case> {};

DIST_TEST_P(StageParity, MatchesSingleProcessTorch) {
  const Case& c = param;
  auto comm = test::communicator(c.backend);
  if (!comm) GTEST_SKIP() << test::not_built(c.backend);  // the build decides: same on every rank
  if (c.shard_group > 0 && (comm->size() % c.shard_group != 0 || comm->size() == c.shard_group)) {
    GTEST_SKIP() << "hybrid sharding needs several groups of " << c.shard_group << " ranks";
  }
  const auto reference = train_reference(c);
  const ShardedRun run = train_sharded(c, comm);
  std::string worst;
  const double diff = max_abs_diff(run.params, reference, &worst);
  EXPECT_LE(diff, 1e-6) << "worst parameter: " << worst;
  // Sanity: training moved the parameters (a test that cannot fail is a defect).
  TinyNet initial;
  std::string moved;
  EXPECT_GT(max_abs_diff(run.params, [&] {
              std::map<std::string, at::Tensor> m;
              for (auto& [n, t] : initial.named) m[n] = t.detach();
              return m;
            }(), &moved), 1e-3);
  EXPECT_TRUE(run.params.at("frozen.scale").equal(initial.by_name["frozen.scale"].detach()));
  const bool persisted = !c.persist || run.memory.persistent_param_bytes > 0;
  EXPECT_TRUE(persisted) << "nothing persisted";
  EXPECT_TRUE(test::all_ranks(diff <= 1e-6 && persisted));
}

std::vector<Case> parity_cases() {
  std::vector<Case> cases;
  for (int stage : {0, 1, 2, 3}) {
    for (const char* rule : {"adamw", "sgd", "lamb"}) cases.push_back({stage, rule});
    for (const char* rule : {"adam", "nesterov", "adagrad", "rmsprop"}) cases.push_back({stage, rule});
    cases.push_back({stage, "adamw", 4});                             // accumulation
    cases.push_back({stage, "sgd", 4});
    for (const char* rule : {"sgd", "adamw"}) {  // (loss / k).backward(), torch's convention
      Case c{stage, rule, 4};
      c.torch_style = true;
      cases.push_back(c);
    }
    cases.push_back({stage, "adamw", 1, 0.05});                       // clipping
    cases.push_back({stage, "lamb", 2, 0.05, true});
    cases.push_back({stage, "adamw", 1, 0.0, true});                  // param groups
    cases.push_back({stage, "sgd", 1, 0.0, true, false});             // no overlap
    cases.push_back({stage, "adamw", 2, 0.0, true, true, 1 << 20});   // one bucket per group
    cases.push_back({stage, "sgd", 1, 0.0, false, true, 64, "gloo"});  // the c10d engine
    // Offload: master weights, state and reduced gradients on the host (on a CPU-only build
    // the same path runs; the master weights are the parameters' own storage).
    cases.push_back({stage, "adamw", 2, 0.05, true, true, 64, "mpi", true});
    cases.push_back({stage, "sgd", 1, 0.0, false, true, 64, "mpi", true});
    // Hybrid sharding: shard groups of 2 (2 hosts x 2 ranks) and of 1 (replicas only).
    for (int group : {1, 2}) {
      Case adamw{stage, "adamw"}, lamb{stage, "lamb", 2, 0.05, true}, sgd{stage, "sgd"};
      sgd.backend = "gloo";
      for (Case* h : {&adamw, &lamb, &sgd}) {
        h->shard_group = group;
        cases.push_back(*h);
      }
    }
    // torch's own ops instead of the fused kernels (RuleStep; Adagrad and RMSprop always).
    for (const char* rule : {"adamw", "sgd", "lamb", "adam"}) {
      Case c{stage, rule};
      c.fused = false;
      cases.push_back(c);
    }
  }
  // Automatic units (src/engine/auto_gather.cpp): every name group is a unit, the tied
  // embedding/decoder a part of its own used twice per forward.
  for (Case c : {Case{3, "adamw"}, Case{3, "sgd"}, Case{3, "adamw", 4}, Case{3, "lamb", 2, 0.05, true},
                 Case{3, "sgd", 1, 0.0, false, true, 64, "gloo"},
                 Case{3, "adamw", 2, 0.05, true, true, 64, "mpi", true},
                 Case{3, "sgd", 1, 0.0, false, false}, Case{3, "adamw", 2, 0.0, true, true, 1 << 20}}) {
    c.auto_units = true;
    cases.push_back(c);
  }
  // Persistent groups: their shard a view into the gathered copy, updated in place (offload: the
  // host master written back into it).
  for (Case c : {Case{3, "adamw"}, Case{3, "sgd", 4}, Case{3, "adamw", 2, 0.05, true, true, 64,
                                                         "mpi", true}}) {
    c.auto_units = c.persist = true;
    cases.push_back(c);
  }
  // Deferred reduction: bucketed gradients summed over the micro-steps, reduced once (stages 2-3,
  // offload, automatic units, the c10d engine; bf16: Precision.DeferredReductionTracksFp32).
  for (Case c : {Case{2, "adamw", 4}, Case{2, "sgd", 4, 0.05, true}, Case{3, "adamw", 4},
                 Case{3, "lamb", 2, 0.05, true}, Case{2, "sgd", 4, 0.0, false, true, 64, "gloo"},
                 Case{2, "adamw", 2, 0.05, true, true, 64, "mpi", true},
                 Case{3, "sgd", 4, 0.0, false, false}, Case{3, "adamw", 4}}) {
    c.defer = true;
    cases.push_back(c);
  }
  cases.back().auto_units = true;
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Stages, StageParity, ::testing::ValuesIn(parity_cases()),
                         [](const auto& info) { return case_name(info.param); });

// Any torch optimizer runs over the shard through a factory; its state is sharded too.
TEST(StageFactory, TorchAdamWOverTheShardMatches) {
  auto comm = test::world();
  for (int stage : {0, 1, 2, 3}) {
    Case c{stage, "adamw"};
    const auto reference = train_reference(c);
    TinyNet net;
    ZeroOptions zo;
    zo.stage = stage_from_int(stage);
    zo.bucket_bytes = 64;
    zo.units = net.units;
    DistributedOptimizer opt(net.groups(false), [](std::vector<at::Tensor> shard) {
      auto a = std::get<AdamW>(make_rule("adamw"));
      return std::make_unique<torch::optim::AdamW>(shard, torch::optim::AdamWOptions(a.lr())
          .betas({a.beta1(), a.beta2()}).eps(a.eps()).weight_decay(a.weight_decay()));
    }, comm, zo);
    const int64_t per_rank = kBatch / comm->size();
    for (int64_t s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      auto [x, y] = batch(s, 0);
      opt.backward(net.loss(x.narrow(0, comm->rank() * per_rank, per_rank),
                            y.narrow(0, comm->rank() * per_rank, per_rank)));
      opt.step();
    }
    opt.gather_full_parameters();
    std::map<std::string, at::Tensor> got;
    for (auto& [name, t] : net.named) got[name] = t.detach();
    std::string worst;
    const double diff = max_abs_diff(got, reference, &worst);
    EXPECT_LE(diff, 1e-6) << "stage " << stage << ", worst " << worst;
    EXPECT_TRUE(test::all_ranks(diff <= 1e-6));
  }
}

// Padded elements of TinyNet's parameters in no unit at stage 3 with 64-byte buckets and
// alignment (16 floats): tiny.bias, unused.weight and embed.weight (1 + 3 + 66) fill buckets of
// 16 * N elements (embed.weight spans several), only the last padded.
int64_t tiny_root_padded(int64_t n) { return detail::round_up(4 + kVocab * kDim, 16 * n); }

// memory() is docs/stages.md's model with padding: K = 8 bytes of AdamW state per element.
TEST(StageMemory, MatchesTheModel) {
  auto comm = test::world();
  const int64_t n = comm->size();
  for (int stage : {0, 1, 2, 3}) {
    const ShardedRun run = train_sharded({stage, "adamw"}, comm);
    const int64_t psi = run.padded_numel;
    const MemoryReport& m = run.memory;
    EXPECT_EQ(m.param_bytes, stage == 3 ? 4 * psi / n : 4 * psi) << "stage " << stage;
    EXPECT_EQ(m.grad_bytes, stage >= 2 ? 4 * psi / n : 4 * psi) << "stage " << stage;
    EXPECT_EQ(m.optimizer_state_bytes, stage == 0 ? 8 * psi : 8 * psi / n) << "stage " << stage;
    if (stage == 2) {
      EXPECT_GT(m.buffer_bytes, 0);
      // Buckets of 16 * N floats, the pool's bound plus one: unused.weight never gets a gradient,
      // so its bucket holds a buffer through backward (Note [Bucket pool bound]).
      EXPECT_LE(m.buffer_bytes, (detail::kBucketPoolBuffers + 1) * 4 * 16 * n);
    } else if (stage == 3) {
      // Nothing stays gathered between steps (not even the parameters in no unit): the
      // gradient buckets alone, as at stage 2.
      EXPECT_LE(m.buffer_bytes, (detail::kBucketPoolBuffers + 1) * 4 * 16 * n);
    } else {
      EXPECT_EQ(m.buffer_bytes, 0);
    }
  }
}

// Stages 0-2 move 2 * padded elements per step and rank (reduce-scatter + all-gather, or an
// all-reduce counted as both). Stage 3 moves 3 * padded: per micro-step, an all-gather of every
// unit in forward and again in backward and a reduce-scatter; except that the parameters in no
// unit stay gathered from zero_grad() through the step, so they are all-gathered once per step.
// (Units run twice or sharing parameters: tests/dist/split_buckets_dist_test.cpp.)
TEST(StageCommunication, TwoPsiPerStepThreeForStage3) {
  auto comm = test::world();
  const int64_t n = comm->size();
  for (int stage : {0, 1, 2, 3}) {
    for (int accumulation : {1, 4}) {
      Case c{stage, "adamw", accumulation};
      const ShardedRun run = train_sharded(c, comm);
      const int64_t psi = run.padded_numel;
      int64_t expected = 0;
      if (stage == 3) {
        const int64_t root = tiny_root_padded(n);
        expected = accumulation * (2 * (psi - root) + psi) + root;
      } else if (n == 1 && stage <= 1) {
        // One rank reads the gradients where autograd left them and reduces nothing (Note
        // [Gradients where autograd left them]); stage 1 still all-gathers its one shard.
        expected = stage == 1 ? psi : 0;
      } else {
        // Stage 2 reduces every micro-step; stages 0-1 once per step.
        expected = (stage == 2 ? accumulation : 1) * psi + psi;
      }
      EXPECT_EQ(run.reported_comm, expected)
          << "stage " << stage << " accumulation " << accumulation;
      // Sharded stages also all-reduce the one-element non-finite flag (counted as 2), which
      // last_step().comm_elements leaves out.
      const int64_t flag = test::nonfinite_flag_elements(stage, n);
      EXPECT_EQ(run.comm_per_step, expected + flag) << "measured by the counting communicator";
    }
  }
}

// Under mixed precision or offload, gradients leave autograd per bucket at every stage (the fp32
// or host master needs them cast or moved), so stages 0-1 reduce every micro-step too, as
// options.hpp and the README state.
TEST(StageCommunication, MixedPrecisionAndOffloadReduceEveryMicroStep) {
  auto comm = test::world();
  for (int stage : {0, 1}) {
    for (bool offload : {true, false}) {
      Case c{stage, "adamw", /*accumulation=*/4};
      c.offload = offload;
      c.precision = offload ? Precision::FP32 : Precision::BF16;
      const ShardedRun run = train_sharded(c, comm);
      const int64_t psi = run.padded_numel;
      // Stage 0 all-reduces (counted as 2 * padded) every micro-step; stage 1 reduce-scatters
      // every micro-step and all-gathers once.
      const int64_t flag = test::nonfinite_flag_elements(stage, comm->size());
      EXPECT_EQ(run.comm_per_step, (stage == 0 ? 4 * 2 * psi : 4 * psi + psi) + flag)
          << case_name(c);
    }
  }
}

// Note [Deferred reduction]: one reduction per step whatever the accumulation, for the full
// gradients held in the bucket buffers until then (reduce dtype: fp32 here).
TEST(StageCommunication, DeferredReductionReducesOncePerStep) {
  auto comm = test::world();
  const int64_t n = comm->size();
  for (int stage : {2, 3}) {
    Case c{stage, "adamw", /*accumulation=*/4};
    const ShardedRun every = train_sharded(c, comm);
    c.defer = true;
    const ShardedRun deferred = train_sharded(c, comm);
    const int64_t psi = deferred.padded_numel;
    const int64_t root = stage == 3 ? tiny_root_padded(n) : 0;
    // Stage 3 still gathers every unit in forward and backward per micro-step.
    const int64_t expected = stage == 3 ? 4 * 2 * (psi - root) + psi + root : psi + psi;
    EXPECT_EQ(deferred.reported_comm, expected) << "stage " << stage;
    EXPECT_EQ(deferred.comm_per_step, expected + test::nonfinite_flag_elements(stage, n));
    EXPECT_EQ(every.reported_comm - deferred.reported_comm, 3 * psi) << "stage " << stage;
    // The buckets hold every gradient element (with padding) for the step.
    EXPECT_GE(deferred.memory.buffer_bytes, psi * 4) << "stage " << stage;
    EXPECT_LT(every.memory.buffer_bytes, deferred.memory.buffer_bytes) << "stage " << stage;
  }
}

TEST(StageValidation, MismatchedModelsAreNamedOnEveryRank) {
  auto comm = test::world();
  if (comm->size() == 1) GTEST_SKIP() << "needs two ranks";
  TinyNet net(/*wider_fc1=*/comm->rank() == 1);
  bool named = false;
  try {
    DistributedOptimizer opt(net.groups(false), AdamW(0.01), comm, ZeroOptions{});
  } catch (const Error& e) {
    const std::string what = e.what();
    named = e.kind() == ErrorKind::Mismatch && what.find("fc1") != std::string::npos &&
            what.find("rank 1") != std::string::npos;
    EXPECT_TRUE(named) << what;
    if (comm->rank() == 0) std::printf("%s\n", what.c_str());  // the message users see
  }
  EXPECT_TRUE(test::all_ranks(named));
}

TEST(StageValidation, InvalidOptionsAndArgumentsAreClearErrors) {
  auto comm = test::world();
  auto expect_error = [&](ZeroOptions zo, const std::string& needle) {
    TinyNet net;
    test::expect_error([&] { DistributedOptimizer opt(net.groups(false), AdamW(0.01), comm, zo); },
                       ErrorKind::InvalidArgument, {needle});
  };
  ZeroOptions zo;
  zo.stage = static_cast<Stage>(7);
  expect_error(zo, "stage must be 0, 1, 2 or 3, got 7");
  zo = {};
  zo.bucket_bytes = -1;
  expect_error(zo, "bucket_bytes must be >= 0 (0: sized from the model), got -1");
  zo = {};
  zo.grad_accumulation_steps = 0;
  expect_error(zo, "grad_accumulation_steps must be at least 1");
  // More backward() calls than announced: one rule at every stage (stages 2-3 used to average
  // them silently), through backward() and through a plain loss.backward().
  bool refused_everywhere = true;
  for (int stage : {0, 1, 2, 3}) {
    for (bool plain : {false, true}) {
      TinyNet net;
      ZeroOptions once;
      once.stage = stage_from_int(stage);
      once.units = net.units;
      DistributedOptimizer opt(net.groups(false), AdamW(0.01), comm, once);
      auto [x, y] = batch(0, 0);
      opt.backward(net.loss(x, y));
      bool refused = false;
      try {
        if (plain) {
          net.loss(x, y).backward();
        } else {
          opt.backward(net.loss(x, y));
        }
      } catch (const std::exception& e) {
        refused = std::string(e.what()).find("backward pass 2 since the last step(), but "
                                             "grad_accumulation_steps is 1") != std::string::npos;
        EXPECT_TRUE(refused) << e.what();
      }
      EXPECT_TRUE(refused) << "stage " << stage << (plain ? " loss.backward()" : " backward()");
      refused_everywhere = refused_everywhere && refused;
      opt.zero_grad();  // starts over: one more pass and a step are fine
      opt.backward(net.loss(x, y));
      opt.step();
    }
  }
  EXPECT_TRUE(test::all_ranks(refused_everywhere));
}

// A name given to two different tensors (or an empty name) would save a checkpoint that can never
// be loaded: refused at construction on every rank, naming the parameter.
TEST(StageValidation, DuplicateAndEmptyNamesAreRefused) {
  auto comm = test::world();
  bool ok = true;
  for (const std::string& bad : {std::string("fc2.bias"), std::string()}) {
    TinyNet net;
    auto groups = net.groups(false);
    groups[0].params.push_back({bad, at::zeros({2}).set_requires_grad(true)});
    const std::string needle = bad.empty() ? "has an empty name"
                                           : "parameter name 'fc2.bias' is given to two different";
    bool refused = false;
    try {
      DistributedOptimizer opt(groups, AdamW(0.01), comm, ZeroOptions{});
    } catch (const Error& e) {
      refused = e.kind() == ErrorKind::InvalidArgument &&
                std::string(e.what()).find(needle) != std::string::npos;
      EXPECT_TRUE(refused) << e.what();
    }
    EXPECT_TRUE(refused) << "name '" << bad << "' was accepted";
    ok = ok && refused;
  }
  // Tied parameters (one tensor under two names) stay fine: TinyNet's decoder.weight.
  TinyNet net;
  DistributedOptimizer opt(net.groups(false), AdamW(0.01), comm, ZeroOptions{});
  EXPECT_TRUE(test::all_ranks(ok));
}

// Mixed precision: fp16/bf16 parameters with an fp32 master copy track the fp32 run. The
// tolerances are what 10 AdamW steps of lr 0.01 leave after rounding the parameters (|p| <= ~3)
// to the compute dtype: bf16 keeps 8 bits of mantissa, fp16 11. Measured at N = 1..4: 4.5e-3
// (bf16) and 7.2e-4 (fp16); the bounds are about three times that. Stage 3 runs three times: with
// the model's units, with automatic units (no units declared) and with automatic units whose small
// groups persist (the write-back casts into their gathered copy), held to the same bound.
DIST_TEST(Precision, MixedTracksFp32) {
  auto comm = test::world();
  for (Precision precision : {Precision::BF16, Precision::FP16}) {
    const double tol = precision == Precision::BF16 ? 1.5e-2 : 2.5e-3;
    for (int stage : {0, 1, 2, 3, 4, 5}) {  // 4: stage 3, automatic units; 5: and persistent
      for (bool reduce_in_fp32 : {true, false}) {
        Case c{std::min(stage, 3), "adamw", 2, 0.05};
        c.auto_units = stage >= 4;
        c.persist = stage == 5;
        c.precision = precision;
        c.reduce_in_fp32 = reduce_in_fp32;
        const auto reference = train_reference(c);
        const ShardedRun run = train_sharded(c, comm);
        std::string worst;
        const double diff = max_abs_diff(run.params, reference, &worst);
        if (comm->rank() == 0) {
          std::printf("[precision] %s: max |p - p_fp32| = %.3g (%s)\n", case_name(c).c_str(),
                      diff, worst.c_str());
        }
        EXPECT_EQ(run.dtype, precision == Precision::BF16 ? at::kBFloat16 : at::kHalf);
        EXPECT_LE(diff, tol) << case_name(c) << ", worst " << worst;
        EXPECT_GT(diff, 0.0) << "the parameters must really be " << to_string(precision);
        const bool persisted = !c.persist || run.memory.persistent_param_bytes > 0;
        EXPECT_TRUE(persisted) << case_name(c) << ": nothing persisted";
        EXPECT_TRUE(test::all_ranks(diff <= tol && persisted));
      }
    }
  }
}

// Under bf16 every stage buckets its gradients (the fp32 master needs them cast), so deferral
// applies at stages 0-1 too: the sums in the buckets are fp32 (reduce_in_fp32), held to
// MixedTracksFp32's bound.
DIST_TEST(Precision, DeferredReductionTracksFp32) {
  auto comm = test::world();
  for (int stage : {0, 1, 2, 3}) {
    Case c{stage, "adamw", 4, 0.05};
    c.precision = Precision::BF16;
    c.defer = true;
    const auto reference = train_reference(c);
    const ShardedRun run = train_sharded(c, comm);
    std::string worst;
    const double diff = max_abs_diff(run.params, reference, &worst);
    EXPECT_LE(diff, 1.5e-2) << case_name(c) << ", worst " << worst;
    EXPECT_EQ(run.dtype, at::kBFloat16);
    // Once per step: stage 0 all-reduces (counted 2 * padded), stages 1-2 reduce-scatter and
    // all-gather (stage 3 also gathers per micro-step).
    if (stage < 3) EXPECT_EQ(run.reported_comm, 2 * run.padded_numel) << case_name(c);
    EXPECT_TRUE(test::all_ranks(diff <= 1.5e-2));
  }
}

}  // namespace
}  // namespace shardopt
