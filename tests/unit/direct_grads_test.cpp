// One process: the update reads large gradients where autograd left them and small ones from the
// flat buffer (Note [Gradients where autograd left them] in src/engine/gradient_reducer.cpp), with
// the same results as the bucketed path (stage 2, which copies every gradient into its buckets)
// and the same non-finite guarantee.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: not reached through ATen.h on torch 2.6+
#include <gtest/gtest.h>
#include <torch/ordered_dict.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "engine/gradient_reducer.hpp"
#include "shardopt/optimizer.hpp"

namespace shardopt {
namespace {

// The smallest gradient read in place.
constexpr int64_t kBig = detail::kInPlaceGradBytes / sizeof(float);

struct Model {
  at::Tensor w, b, unused;  // `unused` never gets a gradient: it counts as zero, as in place
  at::Tensor big;           // read in place
  torch::OrderedDict<std::string, at::Tensor> named() const {
    torch::OrderedDict<std::string, at::Tensor> n;
    n.insert("w", w);
    n.insert("big", big);
    n.insert("b", b);
    n.insert("unused", unused);
    return n;
  }
  std::vector<at::Tensor> values() const {
    return {w.detach().clone(), b.detach().clone(), unused.detach().clone(), big.detach().clone()};
  }
};

Model make_model() {
  at::manual_seed(7);
  return {at::randn({8, 5}).set_requires_grad(true), at::randn({5}).set_requires_grad(true),
          at::randn({3}).set_requires_grad(true), at::randn({kBig}).set_requires_grad(true)};
}

at::Tensor loss_of(const Model& m, int micro) {
  at::manual_seed(100 + micro);
  const at::Tensor x = at::randn({4, 8});
  const at::Tensor y = (at::matmul(x, m.w) + m.b).tanh();
  return y.pow(2).sum() + (m.big * y.sum()).sum() * 1e-3;
}

ZeroOptions options(int stage, int accumulation, double max_norm) {
  ZeroOptions o;
  o.stage = static_cast<Stage>(stage);
  o.grad_accumulation_steps = accumulation;
  o.max_grad_norm = max_norm;
  return o;
}

// Parameters after `steps` steps of `accumulation` micro-steps each.
std::vector<at::Tensor> train(const Rule& rule, int stage, int accumulation, double max_norm,
                              int steps) {
  Model m = make_model();
  DistributedOptimizer opt(m.named(), rule, make_single_communicator(),
                           options(stage, accumulation, max_norm));
  for (int s = 0; s < steps; ++s) {
    for (int k = 0; k < accumulation; ++k) loss_of(m, s * accumulation + k).backward();
    opt.step();
    EXPECT_FALSE(opt.last_step().skipped);
  }
  return m.values();
}

void expect_same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                 double tol, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (tol == 0) {
      EXPECT_TRUE(a[i].equal(b[i])) << what << ", tensor " << i;
    } else {
      EXPECT_LE((a[i] - b[i]).abs().max().item<double>(), tol) << what << ", tensor " << i;
    }
  }
}

TEST(DirectGradients, LargeGradIsTheTensorAutogradMade) {
  Model m = make_model();
  DistributedOptimizer opt(m.named(), AdamW(1e-2), make_single_communicator(), options(0, 1, 0));
  const void* made = nullptr;
  m.big.register_hook([&](const at::Tensor& g) { made = g.data_ptr(); });
  loss_of(m, 0).backward();
  ASSERT_NE(made, nullptr);
  EXPECT_EQ(m.big.grad().data_ptr(), made) << "the gradient was copied into a flat buffer";
  const at::Tensor before = m.big.detach().clone();
  opt.step();
  EXPECT_FALSE(m.big.detach().equal(before));
  EXPECT_FALSE(m.big.grad().defined()) << "step() consumes the gradients (set_to_none)";
}

// Stage 0 at one rank reads autograd's tensors; stage 2 copies them into buckets. Elementwise
// rules give the same bits; clipping's norm is summed per parameter instead of per bucket.
TEST(DirectGradients, MatchesTheBucketedPath) {
  const std::vector<std::pair<std::string, Rule>> rules = {
      {"adamw", AdamW(1e-2).weight_decay(0.1)},
      {"adam amsgrad", Adam(1e-2).weight_decay(0.05).amsgrad(true)},
      {"sgd nesterov", SGD(0.05).momentum(0.9).nesterov(true).weight_decay(0.01)}};
  for (const auto& [name, rule] : rules) {
    expect_same(train(rule, 0, 1, 0, 3), train(rule, 2, 1, 0, 3), 0, name);
  }
  const Rule adamw = rules.front().second;
  expect_same(train(adamw, 0, 3, 0, 3), train(adamw, 2, 3, 0, 3), 0, "adamw, accumulation 3");
  expect_same(train(adamw, 0, 1, 0.5, 3), train(adamw, 2, 1, 0.5, 3), 1e-6, "adamw, clipped");
}

// Gradients set by hand, one of them not contiguous, reach the update as backward's do.
TEST(DirectGradients, HandSetGradients) {
  auto run = [](int stage) {
    Model m = make_model();
    DistributedOptimizer opt(m.named(), AdamW(1e-2), make_single_communicator(),
                             options(stage, 1, 0));
    at::manual_seed(3);
    m.w.mutable_grad() = at::randn({5, 8}).t();  // transposed: not contiguous
    m.b.mutable_grad() = at::randn({5});
    m.big.mutable_grad() = at::randn({2 * kBig}).slice(0, 0, 2 * kBig, 2);  // strided
    opt.step();
    return m.values();
  };
  expect_same(run(0), run(2), 0, "hand-set gradients");
}

// A NaN written into .grad after backward (after the check ran during backward) skips the step.
TEST(DirectGradients, NaNWrittenAfterBackwardSkipsTheStep) {
  Model m = make_model();
  DistributedOptimizer opt(m.named(), AdamW(1e-2), make_single_communicator(), options(0, 1, 0));
  for (const bool in_place : {false, true}) {
    SCOPED_TRACE(in_place ? "a gradient read in place" : "a copied gradient");
    loss_of(m, 0).backward();
    const auto before = m.values();
    {
      at::NoGradGuard no_grad;
      at::Tensor g = in_place ? m.big.mutable_grad() : m.w.mutable_grad();
      g.view(-1)[3] = std::nan("");
    }
    opt.step();
    EXPECT_TRUE(opt.last_step().skipped);
    for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(m.values()[i].equal(before[i]));
    loss_of(m, 1).backward();  // the next step runs again
    opt.step();
    EXPECT_FALSE(opt.last_step().skipped);
    EXPECT_FALSE(m.values()[0].equal(before[0]));
  }
}

}  // namespace
}  // namespace shardopt
