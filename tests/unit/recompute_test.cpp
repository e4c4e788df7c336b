// shardopt::recompute on one process: bitwise the plain run's gradients (dropout included), the
// caller's random stream untouched, the edge cases of recompute.hpp, and the memory it saves.
#include "shardopt/recompute.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: not reached through ATen.h on torch 2.6
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <string>
#include <vector>

#include "shardopt/error.hpp"
#include "shardopt/memory_tracker.hpp"
#include "support/dropout_blocks.hpp"

namespace shardopt {
namespace {

using test::DropoutBlocks;
using test::Mode;

struct TrainRun {
  std::vector<at::Tensor> grads;  // every parameter's, then the input's (when it requires grad)
  at::Tensor output, after;       // the forward's result; a draw from the generator after backward
};

TrainRun train(Mode mode, bool input_requires_grad, bool with_units = false) {
  DropoutBlocks net(4, 16, 32, mode);
  at::manual_seed(7);
  at::Tensor x = at::randn({8, 16}).set_requires_grad(input_requires_grad);
  at::Tensor y = net.forward(x, mode, with_units);
  y.pow(2).mean().backward();
  TrainRun r;
  for (auto& [name, p] : net.named) r.grads.push_back(p.grad());
  if (input_requires_grad) r.grads.push_back(x.grad());
  r.output = y.detach();
  r.after = at::rand({4});
  return r;
}

void expect_bitwise(const TrainRun& a, const TrainRun& b) {
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    ASSERT_TRUE(a.grads[i].defined() && b.grads[i].defined()) << "gradient #" << i;
    EXPECT_TRUE(a.grads[i].equal(b.grads[i])) << "gradient #" << i;
  }
  EXPECT_TRUE(a.output.equal(b.output));
  EXPECT_TRUE(a.after.equal(b.after)) << "the caller's random stream changed";
}

TEST(Recompute, GradientsBitwiseThePlainRunsWithDropout) {
  for (bool input_grad : {true, false}) {
    SCOPED_TRACE(input_grad ? "input requires grad" : "input does not require grad");
    const TrainRun plain = train(Mode::Plain, input_grad);
    expect_bitwise(train(Mode::Direct, input_grad), plain);
    expect_bitwise(train(Mode::Direct, input_grad, /*with_units=*/true), plain);
    expect_bitwise(train(Mode::Declared, input_grad), plain);
    // The test can fail: dropout draws differ when the generator is not restored.
    at::manual_seed(99);
    EXPECT_FALSE(at::dropout(at::ones({64}), 0.5, true).equal(at::dropout(at::ones({64}), 0.5, true)));
  }
}

TEST(Recompute, NonTensorCapturesSeveralOutputsAndOutputsWithoutGrad) {
  auto run = [](bool recompute_it) {
    at::manual_seed(3);
    auto w = at::randn({5, 5}).set_requires_grad(true);
    auto x = at::randn({3, 5}).set_requires_grad(true);
    auto ids = at::arange(3);  // integer input: never requires grad
    const double scale = 0.5;
    const std::string act = "tanh";
    auto fn = [w, scale, act](const std::vector<at::Tensor>& in) {
      auto h = at::matmul(in[0], w) * scale;
      h = act == "tanh" ? at::tanh(h) : h;
      // A second output that requires grad, one that does not, an integer one and an undefined.
      return std::vector<at::Tensor>{at::dropout(h, 0.1, true), h.sum(1), in[1] * 2,
                                     at::ones({2}), at::Tensor()};
    };
    auto out = recompute_it ? recompute(fn, {x, ids, at::Tensor()}) : fn({x, ids, at::Tensor()});
    EXPECT_EQ(out.size(), 5u);
    EXPECT_FALSE(out[4].defined());
    (out[0].sum() + out[1].pow(2).sum() + out[3].sum()).backward();
    return std::vector<at::Tensor>{w.grad(), x.grad(), out[2]};
  };
  const auto plain = run(false), again = run(true);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(plain[i].equal(again[i])) << i;
}

TEST(Recompute, NestedCallsMatch) {
  auto run = [](bool nested) {
    DropoutBlocks net(4, 8, 16);
    at::manual_seed(11);
    auto x = at::randn({6, 8}).set_requires_grad(true);
    auto pair = [&net, nested](int first) {
      auto b0 = net.blocks[first], b1 = net.blocks[first + 1];
      return [b0, b1, nested](const std::vector<at::Tensor>& in) {
        auto inner = [](DropoutBlocks::Block b) {
          return [b](const std::vector<at::Tensor>& v) { return DropoutBlocks::block(b, v[0]); };
        };
        if (!nested) return DropoutBlocks::block(b1, DropoutBlocks::block(b0, in[0]));
        auto h = recompute(inner(b0), {in[0]});
        return recompute(inner(b1), {h});
      };
    };
    at::Tensor y = x;
    for (int i : {0, 2}) y = nested ? recompute(pair(i), {y}) : pair(i)({y});
    y.sum().backward();
    std::vector<at::Tensor> grads{x.grad()};
    for (auto& [n, p] : net.named) grads.push_back(p.grad());
    return grads;
  };
  const auto plain = run(false), nested = run(true);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(plain[i].equal(nested[i])) << i;
}

TEST(Recompute, DoubleBackwardIsRefusedByName) {
  auto w = at::randn({4, 4}).set_requires_grad(true);
  auto x = at::randn({2, 4}).set_requires_grad(true);
  auto y = recompute([w](const std::vector<at::Tensor>& in) { return at::tanh(at::matmul(in[0], w)); }, {x});
  try {
    torch::autograd::grad({y.sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    ADD_FAILURE() << "double backward through recompute was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("recompute: double backward"), std::string::npos) << e.what();
  }
  // A first-order backward after the refusal still works.
  y.sum().backward();
  EXPECT_TRUE(x.grad().defined());
}

TEST(Recompute, NoGradJustCallsAndEmptyFnIsRefused) {
  at::NoGradGuard no_grad;
  auto x = at::randn({3});
  int calls = 0;
  auto y = recompute([&calls](const std::vector<at::Tensor>& in) { ++calls; return in[0] * 2; }, {x});
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(y.equal(x * 2));
  EXPECT_THROW(detail::recompute_impl(RecomputeFn(), {x}), Error);
}

TEST(Recompute, UnitDeclaredToRecomputeNeedsItsInputs) {
  DropoutBlocks net(1, 4, 4, Mode::Declared);
  EXPECT_TRUE(net.units->recomputes(0));
  try {
    net.units->run(0, [] { return at::ones({1}); });
    ADD_FAILURE() << "run(i, fn) on a recomputing unit was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("block0.unit"), std::string::npos) << e.what();
  }
}

// Peak tracked bytes during backward on a model whose activations dominate (8 blocks, 2048 rows,
// hidden 4x the width): recomputation keeps only each block's input.
TEST(Recompute, PeakBytesDuringBackwardAtMostHalf) {
  auto peak = [](Mode mode) {
    ScopedMemoryTracking tracking;
    auto& t = tracking.tracker();
    DropoutBlocks net(8, 64, 256, mode);
    at::manual_seed(5);
    auto x = at::randn({2048, 64});
    auto loss = net.forward(x, mode, false).pow(2).mean();
    t.reset_peak();
    const int64_t base = t.live_bytes();
    loss.backward();
    return std::make_pair(t.peak_bytes(), base);
  };
  const auto [plain, plain_live] = peak(Mode::Plain);
  const auto [recomputed, recomputed_live] = peak(Mode::Direct);
  std::cout << "peak during backward: plain " << plain << " B (" << plain_live
            << " live after forward), recompute " << recomputed << " B (" << recomputed_live
            << ")\n";
  EXPECT_LE(recomputed * 2, plain);
  EXPECT_GT(plain, 0);
}

}  // namespace
}  // namespace shardopt
