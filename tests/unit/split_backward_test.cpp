// The zero-bubble split backward (src/pipeline/split_backward.hpp): B then W give a full
// backward's gradients bitwise, and W runs no node of the chain to the input again.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include "pipeline/split_backward.hpp"

namespace shardopt {
namespace {

struct Net {
  std::vector<at::Tensor> params;  // weight, bias per layer
};

Net make_net(int layers, int64_t width) {
  at::manual_seed(3);
  Net n;
  for (int l = 0; l < layers; ++l) {
    n.params.push_back(at::randn({width, width}).requires_grad_());
    n.params.push_back(at::randn({width}).requires_grad_());
  }
  return n;
}

at::Tensor forward(const Net& n, at::Tensor x) {
  for (size_t l = 0; l + 1 < n.params.size(); l += 2) {
    x = at::gelu(at::addmm(n.params[l + 1], x, n.params[l].t()));
  }
  return x;
}

// Counts the runs of a node.
struct Count : torch::autograd::FunctionPreHook {
  explicit Count(int* n) : runs(n) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& g) override {
    ++*runs;
    return g;
  }
  int* runs;
};

TEST(SplitBackward, BitwiseFullBackwardAndWeightPassSkipsTheTrunk) {
  const at::Tensor data = at::randn({6, 5}), grad_out = at::randn({6, 5});
  Net full = make_net(3, 5), split = make_net(3, 5);
  for (int mb = 0; mb < 2; ++mb) {  // twice: the second accumulates into .grad
    const at::Tensor x_full = data.clone().requires_grad_();
    torch::autograd::backward({forward(full, x_full)}, {grad_out});

    const at::Tensor x = data.clone().requires_grad_();
    const at::Tensor out = forward(split, x);
    detail::SplitBackward pass;
    const at::Tensor dx = pass.backward_input({out}, {grad_out}, {x}, split.params).at(0);
    ASSERT_TRUE(pass.split());
    EXPECT_TRUE(at::equal(dx, x_full.grad()));
    for (const auto& p : split.params) EXPECT_FALSE(p.grad().defined() && mb == 0);
    // The output's node (GELU's backward) is on the trunk: W must not run it again.
    int runs = 0;
    out.grad_fn()->add_pre_hook(std::make_unique<Count>(&runs));
    pass.backward_weight({out}, {grad_out}, {x}, split.params);
    EXPECT_EQ(runs, 0);
    for (size_t i = 0; i < split.params.size(); ++i) {
      EXPECT_TRUE(at::equal(split.params[i].grad(), full.params[i].grad())) << "parameter " << i;
    }
  }
}

TEST(SplitBackward, ParameterUsedTwiceFallsBackToAFullTraversal) {
  Net n = make_net(1, 4), reference = make_net(1, 4);
  const at::Tensor data = at::randn({3, 4}), grad_out = at::randn({3, 4});
  const auto twice = [](const Net& net, const at::Tensor& x) {
    return forward(net, forward(net, x));  // the same layer applied twice
  };
  torch::autograd::backward({twice(reference, data.clone().requires_grad_())}, {grad_out});
  const at::Tensor x = data.clone().requires_grad_();
  const at::Tensor out = twice(n, x);
  detail::SplitBackward pass;
  pass.backward_input({out}, {grad_out}, {x}, n.params);
  EXPECT_FALSE(pass.split());
  pass.backward_weight({out}, {grad_out}, {x}, n.params);
  for (size_t i = 0; i < n.params.size(); ++i) {
    EXPECT_TRUE(at::allclose(n.params[i].grad(), reference.params[i].grad(), 0, 1e-6));
  }
}

}  // namespace
}  // namespace shardopt
