// Split records (Note [Split records] in shardopt/tensor_parallel.hpp): the split layers mark
// their parameters; a hand-made parameter marked with mark_split / mark_replicated is treated as
// the layer's by the optimizer (the grid's clipping norm, without a list of names) and by
// checkpoints (the manifest carries the split and a load checks it against the model's). Runs at
// t = the world size (1..4), on MPI ranks and thread-ranks alike.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "shardopt/checkpoint.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/parallel_layout.hpp"
#include "shardopt/tensor_parallel.hpp"
#include "support/dist_env.hpp"
#include "support/expect_error.hpp"

namespace shardopt {
namespace {

constexpr int64_t kIn = 4;

void expect_split(const at::Tensor& p, const tp::Split& want, const char* what) {
  const auto record = tp::record_of(p);
  ASSERT_TRUE(record.has_value()) << what << " has no record";
  ASSERT_TRUE(record->split.has_value()) << what << " is not split";
  EXPECT_EQ(*record->split, want) << what;
  EXPECT_FALSE(record->sequence_parallel) << what;
}

// An MLP x -> down(gelu(up(x))) made of the split layers.
struct Block : torch::nn::Module {
  explicit Block(const tp::TensorParallel& tp)
      : up(register_module("up", tp::ColumnParallelLinear(kIn, 4 * tp.group->size(), tp))),
        down(register_module("down", tp::RowParallelLinear(4 * tp.group->size(), kIn, tp))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kIn})))),
        emb(register_module("emb", tp::VocabParallelEmbedding(8 * tp.group->size(), kIn, tp))) {}
  tp::ColumnParallelLinear up;
  tp::RowParallelLinear down;
  torch::nn::LayerNorm norm;
  tp::VocabParallelEmbedding emb;
};

// The gradient norm DistributedOptimizer reports for the MLP's gradients of `loss`, no tensor
// group given: the records say which parameters are split.
double reported_norm(const std::vector<std::pair<std::string, at::Tensor>>& params,
                     const ParallelGroups& g, const std::function<at::Tensor()>& loss) {
  ParamGroup group;
  for (const auto& [name, t] : params) group.params.push_back({name, t});
  ZeroOptions zo;
  zo.max_grad_norm = 1e6;  // the norm is computed; nothing is clipped
  zo.timeout = std::chrono::seconds(60);
  DistributedOptimizer opt({group}, SGD(0.01), g.dp, zo);
  opt.zero_grad();
  opt.backward(loss());
  opt.step();
  return opt.last_step().grad_norm;
}

DIST_TEST(TensorParallelRecords, LayersMarkTheirParametersAndHandMadeOnesBehaveAlike) {
  auto world = test::world();
  const int t = world->size();
  const ParallelGroups g = make_parallel_groups(world, ParallelLayout{t});
  auto draws = test::seeded_draws(7);  // the replicated bias alike on every tensor rank
  Block block(tp::TensorParallel{g.tp, false, 1});
  draws.unlock();
  block.to(at::kDouble);  // module.to() keeps the TensorImpl, hence the record
  expect_split(block.up->weight, {0, 4 * t, 4 * t}, "up.weight");
  expect_split(block.up->bias, {0, 4 * t, 4 * t}, "up.bias");
  expect_split(block.down->weight, {1, 4 * t, 4 * t}, "down.weight");
  expect_split(block.emb->weight, {0, 8 * t, 8 * t}, "emb.weight");
  const auto bias = tp::record_of(block.down->bias);
  ASSERT_TRUE(bias.has_value());
  EXPECT_FALSE(bias->split.has_value());
  EXPECT_EQ(bias->group, g.tp);
  EXPECT_FALSE(tp::record_of(block.norm->weight).has_value());
  EXPECT_FALSE(tp::record_of(block.up->weight.detach()).has_value());  // another tensor

  // The same MLP from hand-made tensors with the layers' values, marked by hand.
  at::Tensor w1, b1, w2, b2;
  {
    at::NoGradGuard no_grad;
    w1 = block.up->weight.clone().requires_grad_(true);
    b1 = block.up->bias.clone().requires_grad_(true);
    w2 = block.down->weight.clone().requires_grad_(true);
    b2 = block.down->bias.clone().requires_grad_(true);
  }
  EXPECT_FALSE(tp::record_of(w1).has_value());
  tp::mark_split(w1, g.tp, 0, 4 * t, 4 * t);
  tp::mark_split(b1, g.tp, 0, 4 * t, 4 * t);
  tp::mark_split(w2, g.tp, 1, 4 * t, 4 * t);
  tp::mark_replicated(b2, g.tp);
  EXPECT_EQ(*tp::split_of(w2), *tp::split_of(block.down->weight));

  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(41);
  const at::Tensor x = at::randn({3, kIn}, gen).to(at::kDouble);
  // What the layers do, spelled out with the region mappings (Note [Split regions]).
  const auto mlp_loss = [&](const at::Tensor& a, const at::Tensor& c, const at::Tensor& d,
                            const at::Tensor& e) {
    const at::Tensor h = at::gelu(at::linear(tp::copy_to_region(x, g.tp), a, c));
    return (tp::reduce_from_region(at::matmul(h, d.t()), g.tp) + e).pow(2).sum();
  };
  // The grid's norm by hand, from unmarked copies: split gradients summed over the tensor ranks,
  // the replicated bias's counted once.
  std::vector<at::Tensor> ref;
  for (const at::Tensor* p : {&w1, &b1, &w2, &b2}) {
    ref.push_back(p->detach().clone().requires_grad_(true));
  }
  mlp_loss(ref[0], ref[1], ref[2], ref[3]).backward();
  at::Tensor split_sq = at::zeros({1}, at::kDouble);
  for (int i = 0; i < 3; ++i) split_sq += ref[i].grad().pow(2).sum();
  g.tp->all_reduce(split_sq);
  const double expected =
      std::sqrt(split_sq.item<double>() + ref[3].grad().pow(2).sum().item<double>());

  const double layers = reported_norm(
      {{"up.weight", block.up->weight}, {"up.bias", block.up->bias},
       {"down.weight", block.down->weight}, {"down.bias", block.down->bias}},
      g, [&] { return block.down->forward(at::gelu(block.up->forward(x))).pow(2).sum(); });
  const double hand = reported_norm({{"w1", w1}, {"b1", b1}, {"w2", w2}, {"b2", b2}}, g,
                                    [&] { return mlp_loss(w1, b1, w2, b2); });
  EXPECT_NEAR(layers, expected, 1e-12 * expected);
  EXPECT_NEAR(hand, expected, 1e-12 * expected);
  EXPECT_TRUE(test::all_ranks(std::abs(layers - expected) <= 1e-12 * expected &&
                              std::abs(hand - expected) <= 1e-12 * expected));
}

DIST_TEST(TensorParallelRecords, ClearErrors) {
  auto world = test::world();
  const int t = world->size();
  const ParallelGroups g = make_parallel_groups(world, ParallelLayout{t});
  at::Tensor p = at::zeros({2, 3}, at::kDouble).requires_grad_(true);
  test::expect_error([&] { tp::mark_split(p, g.tp, 0, 2 * t, 2 * t + 1); },
                     ErrorKind::InvalidArgument, {"padded_size must be the tensor's size"});
  test::expect_error([&] { tp::mark_split(p, g.tp, 2, 3, 3); }, ErrorKind::InvalidArgument,
                     {"dim must be in [0, 2)"});
  test::expect_error([&] { tp::mark_split(p, nullptr, 0, 2, 2); }, ErrorKind::InvalidArgument,
                     {"the group is null"});
  tp::mark_split(p, g.tp, 0, 2 * t, 2 * t);
  test::expect_error([&] { tp::mark_sequence_parallel(p, g.tp); }, ErrorKind::InvalidArgument,
                     {"only a replicated parameter is used on sequence shards"});
  if (t > 1) {
    // Marked over a group of another size than the other split parameters'.
    at::Tensor q = at::zeros({2}, at::kDouble).requires_grad_(true);
    tp::mark_replicated(q, g.dp);  // the data-parallel group: 1 rank here
    ParamGroup group;
    group.params = {{"p", p}, {"q", q}};
    test::expect_error([&] { DistributedOptimizer({group}, SGD(0.1), g.dp, ZeroOptions{}); },
                       ErrorKind::InvalidArgument,
                       {"parameter 'q' is marked replicated over a tensor group of 1 rank(s)"});
  }
}

// The manifest records each split; a model whose split differs (here its padding) is refused.
DIST_TEST(TensorParallelRecords, CheckpointsCarryTheSplit) {
  auto world = test::world();
  const int t = world->size();
  const ParallelGroups g = make_parallel_groups(world, ParallelLayout{t});
  Block block(tp::TensorParallel{g.tp, false, 1});
  ParamGroup group;
  for (const auto& item : block.named_parameters()) {
    group.params.push_back({item.key(), item.value()});
  }
  ZeroOptions zo;
  zo.timeout = std::chrono::seconds(60);
  DistributedOptimizer opt({group}, SGD(0.1), g.dp, zo);
  // Each tensor rank checkpoints its slices in a folder of its own (g.dp has one rank here).
  const std::string base = test::shared_dir("split-records");
  const std::string dir = base + "/tp" + std::to_string(g.tp_rank);
  save_checkpoint(opt, dir);
  const CheckpointInfo info = read_checkpoint_info(dir);
  bool found = false;
  for (const auto& p : info.params) {
    if (p.name != "emb.weight") continue;
    found = true;
    const std::vector<int64_t> want =
        t > 1 ? std::vector<int64_t>{0, 8 * t, 8 * t} : std::vector<int64_t>{};
    EXPECT_EQ(p.split, want);
  }
  EXPECT_TRUE(found);
  load_checkpoint(opt, dir);  // the same splits: loads
  // Same local shape, another split: 8t - 1 real rows of 8t.
  tp::mark_split(block.emb->weight, g.tp, 0, 8 * t - 1, 8 * t);
  test::expect_error([&] { load_checkpoint(opt, dir); }, ErrorKind::Checkpoint,
                     {"parameter 'emb.weight' is split along dim 0 (full size " +
                      std::to_string(8 * t - 1) + ", padded size " + std::to_string(8 * t) +
                      ") in the model but"});
  world->barrier();
  std::error_code ec;
  if (world->rank() == 0) std::filesystem::remove_all(base, ec);
}

}  // namespace
}  // namespace shardopt
