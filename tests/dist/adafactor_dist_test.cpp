// Adafactor at stages 0-3 against torch.optim.Adafactor's algorithm in one process
// (support/reference_adafactor.hpp) on float64: matrices split mid-row across ranks and buckets, a
// batched 3-D weight, the degenerate (m, 1) and (1, n) matrices, vectors and a scalar, two
// parameter groups; within 1e-10 after the steps. Also: a sharded checkpoint written at stage 3
// resumes at stage 0 on the same path. The reference itself is held to torch 2.15's
// torch.optim.Adafactor (support/adafactor_golden.hpp).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "shardopt/estimate.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/parallel_layout.hpp"
#include "shardopt/state_dict.hpp"
#include "shardopt/tensor_parallel.hpp"
#include "support/adafactor_golden.hpp"
#include "support/dist_env.hpp"
#include "support/expect_error.hpp"
#include "support/reference_adafactor.hpp"

namespace shardopt {
namespace {

constexpr int64_t kSamples = 12, kSteps = 6;

struct Shape {
  const char* name;
  std::vector<int64_t> sizes;
};
const std::vector<Shape> kShapes = {
    {"embed.weight", {11, 3}}, {"attn.weight", {2, 3, 4}}, {"proj.weight", {7, 5}},
    {"proj.bias", {7}},        {"gate.weight", {6, 1}},    {"head.weight", {1, 9}},
    {"norm.scale", {}}};

// float64 parameters from a fixed seed; the loss of samples [lo, hi) is their mean of
// sum_p (A_i,p * tanh(p)).sum(), so the rank-averaged gradient is the global batch's.
struct FactorNet {
  std::vector<std::pair<std::string, at::Tensor>> named;
  FactorNet() {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(4242);
    for (const auto& s : kShapes) {
      named.emplace_back(s.name, (at::randn(s.sizes, gen, at::kDouble) * 0.5).set_requires_grad(true));
    }
  }
  // Matrices in group 0; vectors and the scalar in group 1 (its own lr and weight decay).
  std::vector<ParamGroup> groups() {
    ParamGroup matrices, others;
    others.lr = 0.02;
    others.weight_decay = 0.0;
    for (auto& [name, t] : named) (t.dim() > 1 ? matrices : others).params.push_back({name, t});
    return {matrices, others};
  }
  at::Tensor loss(int64_t step, int64_t lo, int64_t hi) {
    at::Tensor total = at::zeros({}, at::kDouble);
    for (size_t p = 0; p < named.size(); ++p) {
      at::Tensor coef = at::zeros_like(named[p].second).detach();
      for (int64_t i = lo; i < hi; ++i) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step * 997 + i * 31 + p);
        coef += at::randn(named[p].second.sizes(), gen, at::kDouble);
      }
      total = total + (coef / static_cast<double>(hi - lo) * at::tanh(named[p].second)).sum();
    }
    return total;
  }
  std::map<std::string, at::Tensor> values() const {
    std::map<std::string, at::Tensor> out;
    for (auto& [name, t] : named) out[name] = t.detach().clone();
    return out;
  }
};

Adafactor tuned() {
  return Adafactor(0.05).beta2_decay(-0.5).eps1(1e-30).eps2(1e-3).d(1.5).weight_decay(0.1)
      .maximize(true);
}

// One process, whole tensors, the whole batch: the definition sharded Adafactor must reproduce.
// `state_of`: each parameter's torch state, by name, after the steps.
std::map<std::string, at::Tensor> reference(
    const Adafactor& rule, int64_t steps,
    std::map<std::string, test::AdafactorTensorState>* state_of = nullptr) {
  FactorNet net;
  auto groups = net.groups();
  test::AdafactorStates states;
  for (int64_t s = 0; s < steps; ++s) {
    for (auto& [name, t] : net.named) t.mutable_grad() = at::Tensor();
    net.loss(s, 0, kSamples).backward();
    for (const auto& g : groups) {
      Adafactor r = rule;
      if (g.lr) r.lr(*g.lr);
      if (g.weight_decay) r.weight_decay(*g.weight_decay);
      std::vector<at::Tensor> ps;
      for (const auto& np : g.params) ps.push_back(np.tensor);
      test::reference_adafactor_step(ps, r, states);
    }
  }
  if (state_of) {
    for (auto& [name, t] : net.named) (*state_of)[name] = states.at(t.unsafeGetTensorImpl());
  }
  return net.values();
}

ZeroOptions options(int stage) {
  ZeroOptions zo;
  zo.stage = stage_from_int(stage);
  zo.bucket_bytes = 96;  // 12 doubles: matrices split across buckets and mid-row across ranks
  zo.timeout = std::chrono::seconds(60);
  return zo;
}

void train(FactorNet& net, DistributedOptimizer& opt, int64_t from, int64_t to) {
  const auto comm = test::world();
  const int64_t per_rank = kSamples / comm->size();
  for (int64_t s = from; s < to; ++s) {
    opt.zero_grad();
    opt.backward(net.loss(s, comm->rank() * per_rank, (comm->rank() + 1) * per_rank));
    opt.step();
  }
  opt.gather_full_parameters();  // stage 3: whole again to be read
}

double max_diff(const std::map<std::string, at::Tensor>& a,
                const std::map<std::string, at::Tensor>& b, std::string* worst) {
  double d = 0;
  for (const auto& [name, t] : a) {
    const double di = (t - b.at(name)).abs().max().item<double>();
    if (di > d) {
      d = di;
      *worst = name;
    }
  }
  return d;
}

// The C++ port against torch.optim.Adafactor's own values (tests/python/make_adafactor_golden.py:
// the same closed-form parameters and gradients, six steps, two configurations). One process.
TEST(AdafactorReference, MatchesTorchGolden) {
  const std::vector<std::vector<int64_t>> shapes = {{11, 3}, {2, 3, 4}, {7, 5}, {7}, {6, 1},
                                                    {1, 9}, {}};
  for (const char* config : {"default", "tuned"}) {
    const Adafactor rule = std::string(config) == "tuned" ? tuned() : Adafactor();
    std::vector<at::Tensor> params;
    for (size_t i = 0; i < shapes.size(); ++i) {
      int64_t n = 1;
      for (int64_t d : shapes[i]) n *= d;
      const at::Tensor k = at::arange(n, at::kDouble);
      params.push_back((0.5 * at::sin(0.37 * k + static_cast<double>(i))).reshape(shapes[i]));
    }
    test::AdafactorStates states;
    for (int64_t step = 0; step < 6; ++step) {
      for (size_t i = 0; i < params.size(); ++i) {
        const at::Tensor k = at::arange(params[i].numel(), at::kDouble).reshape(shapes[i]);
        params[i].mutable_grad() =
            at::cos(0.11 * k * static_cast<double>(step + 1) + static_cast<double>(i)) *
                (1 + 0.1 * static_cast<double>(step)) +
            0.5 * params[i];
      }
      test::reference_adafactor_step(params, rule, states);
    }
    size_t i = 0, checked = 0;
    for (const auto& golden : test::adafactor_golden()) {
      if (std::string(golden.config) != config) continue;
      const at::Tensor want = at::tensor(golden.values, at::kDouble);
      const double diff = (params[i].reshape({-1}) - want).abs().max().item<double>();
      EXPECT_LE(diff, 1e-12) << config << " " << golden.param;
      ++i;
      ++checked;
    }
    EXPECT_EQ(checked, shapes.size()) << config;
  }
}

struct Case {
  int stage;
  bool tuned;
};

class AdafactorParity : public ::testing::TestWithParam<Case> {};

DIST_TEST_P(AdafactorParity, MatchesTorchAlgorithm) {
  const Case& c = param;
  const Adafactor rule = c.tuned ? tuned() : Adafactor();
  const auto expected = reference(rule, kSteps);
  FactorNet net;
  const auto initial = net.values();
  DistributedOptimizer opt(net.groups(), rule, test::world(), options(c.stage));
  train(net, opt, 0, kSteps);
  std::string worst, moved;
  const double diff = max_diff(net.values(), expected, &worst);
  EXPECT_LE(diff, 1e-10) << "worst parameter: " << worst;
  EXPECT_GT(max_diff(net.values(), initial, &moved), 1e-3);  // training moved the parameters
  // One float64 state element per parameter element of this rank's updated range.
  const int64_t n = test::world()->size();
  const int64_t state = 8 * (c.stage == 0 ? opt.padded_numel() : opt.padded_numel() / n);
  EXPECT_EQ(opt.memory().optimizer_state_bytes, state);
  EXPECT_TRUE(test::all_ranks(diff <= 1e-10 && opt.memory().optimizer_state_bytes == state));
}

INSTANTIATE_TEST_SUITE_P(Stages, AdafactorParity,
                         ::testing::Values(Case{0, false}, Case{1, false}, Case{2, false},
                                           Case{3, false}, Case{0, true}, Case{1, true},
                                           Case{2, true}, Case{3, true}),
                         [](const auto& info) {
                           return fmt::format("stage{}{}", info.param.stage,
                                              info.param.tuned ? "_tuned" : "");
                         });

// The factored state travels in sharded checkpoints: saved at stage 3, resumed at stage 0.
DIST_TEST(AdafactorCheckpoint, ResumesAcrossStages) {
  const auto expected = reference(tuned(), kSteps);
  const std::string dir = test::shared_dir("adafactor-ckpt");
  {
    FactorNet net;
    DistributedOptimizer opt(net.groups(), tuned(), test::world(), options(3));
    train(net, opt, 0, kSteps / 2);
    opt.save_checkpoint(dir + "/ckpt");
  }
  FactorNet net;
  DistributedOptimizer opt(net.groups(), tuned(), test::world(), options(0));
  opt.load_checkpoint(dir + "/ckpt");
  train(net, opt, kSteps / 2, kSteps);
  std::string worst;
  const double diff = max_diff(net.values(), expected, &worst);
  EXPECT_LE(diff, 1e-10) << "worst parameter: " << worst;
  EXPECT_TRUE(test::all_ranks(diff <= 1e-10));
  if (test::world()->rank() == 0) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
}

// torch's state-dict contract: the consolidated state holds torch's row_var / col_var / variance
// (as the reference keeps them), and a state dict loaded from torch's state continues the run.
DIST_TEST(AdafactorStateDict, TorchBuffersBothWays) {
  std::map<std::string, test::AdafactorTensorState> torch_state;
  const auto halfway = reference(tuned(), kSteps / 2, &torch_state);
  const auto expected = reference(tuned(), kSteps);
  FactorNet net;
  DistributedOptimizer opt(net.groups(), tuned(), test::world(), options(2));
  train(net, opt, 0, kSteps / 2);
  opt.consolidate_state_dict(0);
  double diff = 0;
  bool names_ok = true;
  if (test::world()->rank() == 0) {
    const OptimizerStateDict& sd = opt.state_dict();
    for (const auto& group : sd.groups) {
      for (const auto& p : group.params) {
        const auto& want = torch_state.at(p.name);
        const bool factored = want.row_var.defined();
        names_ok = names_ok && p.state.size() == (factored ? 2u : 1u);
        for (const auto& [key, t] : p.state) {
          const at::Tensor& w = key == "row_var" ? want.row_var
                                : key == "col_var" ? want.col_var : want.variance;
          names_ok = names_ok && w.defined() && t.sizes() == w.sizes();
          if (names_ok) diff = std::max(diff, (t - w).abs().max().item<double>());
        }
      }
    }
  }
  EXPECT_TRUE(names_ok);
  EXPECT_LE(diff, 1e-12);
  // torch's state of the reference, as the state dict every rank loads into a fresh optimizer.
  OptimizerStateDict from_torch;
  from_torch.step = kSteps / 2;
  FactorNet shapes;
  for (const auto& g : shapes.groups()) {
    Adafactor r = tuned();
    if (g.lr) r.lr(*g.lr);
    if (g.weight_decay) r.weight_decay(*g.weight_decay);
    OptimizerStateDict::Group group{r, {}};
    for (const auto& np : g.params) {
      const auto& st = torch_state.at(np.name);
      OptimizerStateDict::Param p{np.name, {}};
      if (st.row_var.defined()) {
        p.state["row_var"] = st.row_var.clone();
        p.state["col_var"] = st.col_var.clone();
      } else {
        p.state["variance"] = st.variance.clone();
      }
      group.params.push_back(p);
    }
    from_torch.groups.push_back(group);
  }
  FactorNet resumed;
  {
    // Start from the reference's parameters after half the steps.
    at::NoGradGuard no_grad;
    for (auto& [name, t] : resumed.named) t.copy_(halfway.at(name));
  }
  DistributedOptimizer again(resumed.groups(), tuned(), test::world(), options(3));
  again.load_state_dict(from_torch);
  train(resumed, again, kSteps / 2, kSteps);
  std::string worst;
  const double resumed_diff = max_diff(resumed.values(), expected, &worst);
  EXPECT_LE(resumed_diff, 1e-10) << "worst parameter: " << worst;
  EXPECT_TRUE(test::all_ranks(names_ok && diff <= 1e-12 && resumed_diff <= 1e-10));
}

// float32 weights, bf16 mixed precision (fp32 master weights, eps1 from float32) and hybrid
// sharding (statistics all-reduced within each shard group) track the float64 reference.
DIST_TEST(AdafactorVariants, Fp32Bf16AndHybridTrackTheReference) {
  const auto expected = reference(Adafactor(), kSteps);
  const auto start = FactorNet().values();
  const int world = test::world()->size();
  // float32 weights (the float kernel path: within 1e-4 of the float64 reference, relative to how
  // far it moved) and bf16 with float32 master weights (within 0.25: Adafactor normalises each
  // update by its RMS, so an element whose tiny gradient bf16 rounds to the other sign moves the
  // other way by a whole step; the scalar norm.scale is that one element).
  for (const Precision precision : {Precision::FP32, Precision::BF16}) {
    FactorNet net;  // FactorNet's parameters as float32 (bf16 once the optimizer holds them)
    for (auto& [name, t] : net.named) t = t.detach().to(at::kFloat).set_requires_grad(true);
    ZeroOptions zo = options(2);
    zo.precision = precision;
    DistributedOptimizer opt(net.groups(), Adafactor(), test::world(), zo);
    const int64_t per_rank = kSamples / world, rank = test::world()->rank();
    for (int64_t s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      at::Tensor total = at::zeros({}, at::kFloat);
      for (size_t p = 0; p < net.named.size(); ++p) {  // FactorNet::loss in the weights' dtype
        const at::Tensor& t = net.named[p].second;
        at::Tensor coef = at::zeros(t.sizes(), at::kDouble);
        for (int64_t i = rank * per_rank; i < (rank + 1) * per_rank; ++i) {
          auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + s * 997 + i * 31 + p);
          coef += at::randn(t.sizes(), gen, at::kDouble);
        }
        total = total + (coef.div(per_rank).to(t.scalar_type()) * at::tanh(t)).sum().to(at::kFloat);
      }
      opt.backward(total);
      opt.step();
    }
    double off = 0, moved = 0;
    for (auto& [name, t] : net.named) {
      off += (t.detach().to(at::kDouble) - expected.at(name)).pow(2).sum().item<double>();
      moved += (expected.at(name) - start.at(name)).pow(2).sum().item<double>();
    }
    const double ratio = std::sqrt(off / moved);
    const double bound = precision == Precision::FP32 ? 1e-4 : 0.25;
    EXPECT_LE(ratio, bound) << to_string(precision);
    EXPECT_TRUE(test::all_ranks(ratio <= bound));
    std::printf("[adafactor %s] |weights - reference| / |reference - start| = %.3g\n",
                to_string(precision), ratio);
  }
  if (world == 4) {  // two shard groups of two ranks
    FactorNet net;
    ZeroOptions zo = options(2);
    zo.shard_group_size = 2;
    DistributedOptimizer opt(net.groups(), Adafactor(), test::world(), zo);
    train(net, opt, 0, kSteps);
    std::string worst;
    const double diff = max_diff(net.values(), expected, &worst);
    EXPECT_LE(diff, 1e-10) << "hybrid, worst parameter: " << worst;
    EXPECT_TRUE(test::all_ranks(diff <= 1e-10));
  }
}

// A parameter split by tensor parallelism is refused by name (its statistics and RMS would be
// partial).
DIST_TEST(AdafactorErrors, TensorParallelSplitsAreRefused) {
  auto world = test::world();
  if (world->size() < 2) GTEST_SKIP() << "tensor parallelism needs two ranks";
  const ParallelGroups g = make_parallel_groups(world, ParallelLayout{world->size()});
  tp::ColumnParallelLinear col(8, 4 * world->size(), tp::TensorParallel{g.tp, false, 1});
  ParamGroup group;
  group.params = {{"col.weight", col->weight}, {"col.bias", col->bias}};
  ZeroOptions zo = options(1);
  zo.grid = g;
  test::expect_error([&] { DistributedOptimizer opt({group}, Adafactor(), g.dp, zo); },
                     ErrorKind::Unsupported, {"adafactor", "'col.", "is split over"});
  // Muon's Newton-Schulz needs the whole matrix too: the same refusal.
  test::expect_error([&] { DistributedOptimizer opt({group}, Muon(), g.dp, zo); },
                     ErrorKind::Unsupported, {"muon", "'col.", "is split over"});
}

// memory() and the estimator agree on Adafactor's state: K = 4 bytes per fp32 parameter.
DIST_TEST(AdafactorMemory, StateBytesAsEstimated) {
  FactorNet net;
  std::vector<ParamGroup> groups = net.groups();
  std::vector<at::Tensor> keep;
  for (auto& g : groups) {
    for (auto& np : g.params) {
      keep.push_back(np.tensor.detach().to(at::kFloat).set_requires_grad(true));
      np.tensor = keep.back();
    }
  }
  DistributedOptimizer opt(groups, Adafactor(), test::world(), options(2));
  const int64_t k = estimate::state_bytes(estimate::Optimizer::Adafactor, Precision::FP32);
  const int64_t want = k * opt.padded_numel() / test::world()->size();
  EXPECT_EQ(k, 4);
  EXPECT_EQ(opt.memory().optimizer_state_bytes, want);
  EXPECT_TRUE(test::all_ranks(opt.memory().optimizer_state_bytes == want));
}

}  // namespace
}  // namespace shardopt
