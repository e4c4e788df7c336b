// The torch optimizer contract across ranks (shardopt/state_dict.hpp): torch::save of the
// consolidated state loads into a plain torch::optim::AdamW and the reverse, each continuing
// exactly as the other would (<= 1e-6); an unconsolidated save throws the named error; and a
// trainer that only knows torch::optim::Optimizer& (zero_grad, step, LR through param_groups)
// trains like one that calls DistributedOptimizer directly, at stages 0-3.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "shardopt/error.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/units.hpp"
#include "support/dist_env.hpp"

namespace shardopt {
namespace {

constexpr int64_t kIn = 6, kHidden = 7, kOut = 5, kRows = 12, kSteps = 3;

// x -> unit fc1 -> * scale (in no unit) -> unit fc2 -> + frozen; MSE. Every unit's parameters are
// read inside run(); `scale` after the first unit entered (which gathers the parameters in no unit
// at stage 3).
struct Mlp {
  std::vector<std::pair<std::string, at::Tensor>> named;
  std::map<std::string, at::Tensor> p;
  UnitsPtr units = std::make_shared<Units>();

  Mlp() {
    at::manual_seed(77);
    add("fc1.weight", at::randn({kIn, kHidden}) * 0.5);
    add("fc1.bias", at::randn({kHidden}) * 0.1);
    add("scale", at::randn({kHidden}));
    add("fc2.weight", at::randn({kHidden, kOut}) * 0.5);
    add("fc2.bias", at::randn({kOut}) * 0.1);
    add("frozen", at::randn({kOut}), /*trainable=*/false);
    units->add("fc1", {p["fc1.weight"], p["fc1.bias"]});
    units->add("fc2", {p["fc2.weight"], p["fc2.bias"]});
  }
  void add(const std::string& name, at::Tensor t, bool trainable = true) {
    t = t.contiguous().set_requires_grad(trainable);
    named.emplace_back(name, t);
    p[name] = t;
  }
  at::Tensor loss(const at::Tensor& x, const at::Tensor& y) {
    at::Tensor h = units->run(0, [&] {
      return at::tanh(at::matmul(x, p["fc1.weight"]) + p["fc1.bias"]);
    });
    h = h * p["scale"];
    h = units->run(1, [&] { return at::matmul(h, p["fc2.weight"]) + p["fc2.bias"]; });
    return at::mse_loss(h + p["frozen"], y);
  }
  std::vector<ParamGroup> groups() {
    ParamGroup g;
    for (auto& [name, t] : named) g.params.push_back({name, t});
    return {g};
  }
  std::vector<at::Tensor> tensors() {
    std::vector<at::Tensor> out;
    for (auto& item : named) out.push_back(item.second);
    return out;
  }
  std::map<std::string, at::Tensor> snapshot() {
    std::map<std::string, at::Tensor> out;
    for (auto& [name, t] : named) out[name] = t.detach().clone();
    return out;
  }
  void load(const std::map<std::string, at::Tensor>& values) {
    at::NoGradGuard no_grad;
    for (auto& [name, t] : named) t.copy_(values.at(name));
  }
};

// The global batch of step s; a rank feeds rows [r * kRows / N, (r + 1) * kRows / N).
std::pair<at::Tensor, at::Tensor> batch(int64_t s) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(500 + s);
  return {at::randn({kRows, kIn}, gen), at::randn({kRows, kOut}, gen)};
}
std::pair<at::Tensor, at::Tensor> my_rows(int64_t s, const Communicator& comm) {
  auto [x, y] = batch(s);
  const int64_t n = kRows / comm.size();
  return {x.narrow(0, comm.rank() * n, n), y.narrow(0, comm.rank() * n, n)};
}

torch::optim::AdamWOptions adamw_options() {
  return torch::optim::AdamWOptions(0.01).weight_decay(0.05);
}
ZeroOptions zero(int stage, const UnitsPtr& units) {
  ZeroOptions zo;
  zo.stage = stage_from_int(stage);
  zo.bucket_bytes = 64;  // parameters split across buckets and ranks
  zo.units = units;
  zo.timeout = std::chrono::seconds(60);
  return zo;
}

void train_sharded(DistributedOptimizer& opt, Mlp& net, int64_t from, int64_t to) {
  for (int64_t s = from; s < to; ++s) {
    auto [x, y] = my_rows(s, *opt.communicator());
    opt.zero_grad();
    opt.backward(net.loss(x, y));
    opt.step();
  }
}
void train_torch(torch::optim::Optimizer& opt, Mlp& net, int64_t from, int64_t to) {
  for (int64_t s = from; s < to; ++s) {
    auto [x, y] = batch(s);
    opt.zero_grad();
    net.loss(x, y).backward();
    opt.step();
  }
}

double max_diff(const std::map<std::string, at::Tensor>& a,
                const std::map<std::string, at::Tensor>& b) {
  double d = 0;
  for (auto& [name, t] : a) d = std::max(d, (t - b.at(name)).abs().max().item<double>());
  return d;
}

// Rank 0's value of `d` on every rank.
double from_rank0(double d) {
  at::Tensor t = at::full({1}, d, at::kDouble);
  test::world()->broadcast(t, 0);
  return t.item<double>();
}

TEST(TorchContract, ShardoptStateLoadsIntoTorchAdamW) {
  auto comm = test::world();
  const std::string dir = test::shared_dir("contract");
  for (int stage : {0, 1, 2, 3}) {
    Mlp net;
    DistributedOptimizer opt(net.groups(), AdamW(0.01).weight_decay(0.05), comm,
                             zero(stage, net.units));
    train_sharded(opt, net, 0, kSteps);
    // Before consolidating, no rank holds the state: the error names the ways out.
    bool named = false;
    try {
      torch::save(opt, dir + "/never.pt");
    } catch (const Error& e) {
      const std::string what = e.what();
      named = e.kind() == ErrorKind::Unsupported &&
              what.find("consolidate_state_dict") != std::string::npos &&
              what.find("save_checkpoint") != std::string::npos;
    }
    EXPECT_TRUE(named) << "stage " << stage;
    EXPECT_FALSE(std::filesystem::exists(dir + "/never.pt"));
    opt.consolidate_state_dict(0);
    const std::string file = dir + "/stage" + std::to_string(stage) + ".pt";
    if (comm->rank() == 0) torch::save(opt, file);
    opt.gather_full_parameters();
    const auto at_save = net.snapshot();
    train_sharded(opt, net, kSteps, 2 * kSteps);
    opt.gather_full_parameters();
    double diff = -1;
    if (comm->rank() == 0) {
      Mlp ref;
      ref.load(at_save);
      torch::optim::AdamW torch_opt(ref.tensors(), adamw_options());
      torch::load(torch_opt, file);
      train_torch(torch_opt, ref, kSteps, 2 * kSteps);
      diff = max_diff(net.snapshot(), ref.snapshot());
    }
    diff = from_rank0(diff);
    EXPECT_LE(diff, 1e-6) << "stage " << stage << " at N=" << comm->size();
    EXPECT_GE(diff, 0.0);
  }
  test::world()->barrier();
}

TEST(TorchContract, TorchAdamWStateLoadsIntoShardopt) {
  auto comm = test::world();
  const std::string dir = test::shared_dir("contract");
  const std::string file = dir + "/torch.pt";
  Mlp ref;
  torch::optim::AdamW torch_opt(ref.tensors(), adamw_options());
  train_torch(torch_opt, ref, 0, kSteps);  // every rank: the same numbers
  if (comm->rank() == 0) torch::save(torch_opt, file);
  comm->barrier();
  const auto at_save = ref.snapshot();
  train_torch(torch_opt, ref, kSteps, 2 * kSteps);
  for (int stage : {0, 1, 2, 3}) {
    Mlp net;
    net.load(at_save);
    DistributedOptimizer opt(net.groups(), AdamW(0.5), comm, zero(stage, net.units));
    torch::load(opt, file);  // every rank; the hyper-parameters come from the file too
    EXPECT_EQ(opt.last_step().step, kSteps);
    EXPECT_EQ(rule_lr(opt.group_rule(0)), 0.01);
    train_sharded(opt, net, kSteps, 2 * kSteps);
    opt.gather_full_parameters();
    const double diff = max_diff(net.snapshot(), ref.snapshot());
    EXPECT_LE(diff, 1e-6) << "stage " << stage << " at N=" << comm->size();
  }
  // And a state dict of another rule is refused on every rank, naming what differs.
  Mlp net;
  DistributedOptimizer sgd(net.groups(), SGD(0.1).momentum(0.9), comm, zero(2, nullptr));
  bool refused = false;
  try {
    torch::load(sgd, file);
  } catch (const Error& e) {
    refused = e.kind() == ErrorKind::Mismatch &&
              std::string(e.what()).find("momentum_buffer") != std::string::npos;
  }
  EXPECT_TRUE(test::all_ranks(refused));
}

// What a generic trainer does with any torch::optim::Optimizer: zero_grad() (the base's on torch
// 1.13), backward, step(), and a learning-rate schedule through param_groups()' options.
void train_generic(torch::optim::Optimizer& opt, Mlp& net, const Communicator& comm) {
  for (int64_t s = 0; s < 2 * kSteps; ++s) {
    for (auto& group : opt.param_groups()) group.options().set_lr(0.01 / (1.0 + s));
    auto [x, y] = my_rows(s, comm);
    opt.zero_grad();
    net.loss(x, y).backward();
    opt.step();
  }
}

TEST(TorchContract, GenericTrainerTrainsLikeDirectUse) {
  auto comm = test::world();
  for (int stage : {0, 1, 2, 3}) {
    Mlp generic_net, direct_net;
    DistributedOptimizer generic(generic_net.groups(), AdamW(0.01).weight_decay(0.05), comm,
                                 zero(stage, generic_net.units));
    DistributedOptimizer direct(direct_net.groups(), AdamW(0.01).weight_decay(0.05), comm,
                                zero(stage, direct_net.units));
    train_generic(generic, generic_net, *comm);
    for (int64_t s = 0; s < 2 * kSteps; ++s) {
      direct.set_group_rule(0, AdamW(0.01 / (1.0 + s)).weight_decay(0.05));
      auto [x, y] = my_rows(s, *comm);
      direct.zero_grad();
      direct.backward(direct_net.loss(x, y));
      direct.step();
    }
    generic.gather_full_parameters();
    direct.gather_full_parameters();
    EXPECT_EQ(max_diff(generic_net.snapshot(), direct_net.snapshot()), 0.0) << "stage " << stage;
    EXPECT_GT(max_diff(generic_net.snapshot(), Mlp().snapshot()), 1e-3);  // it trained
    // Groups are fixed: one added through the base is reported by the next step.
    generic.torch::optim::Optimizer::add_param_group(
        torch::optim::OptimizerParamGroup({at::zeros({2}, at::requires_grad())}));
    bool reported = false;
    try {
      generic.step();
    } catch (const Error& e) {
      reported = e.kind() == ErrorKind::InvalidArgument &&
                 std::string(e.what()).find("add_param_group") != std::string::npos;
    }
    EXPECT_TRUE(reported) << "stage " << stage;
  }
}

// DDP's contract at stage 0: when backward returns, every rank's .grad holds the average gradient
// of the global batch, final, so a trainer may read or change it before step() (Note [Gradients
// are final when backward returns] in src/engine/gradient_reducer.cpp). Small buckets keep several
// reductions in flight at the end of the pass.
TEST(TorchContract, Stage0GradientsAreTheAverageWhenBackwardReturns) {
  auto comm = test::world();
  Mlp net, reference;
  DistributedOptimizer opt(net.groups(), AdamW(0.01).weight_decay(0.05), comm,
                           zero(0, net.units));
  for (int64_t s = 0; s < kSteps; ++s) {
    reference.load(net.snapshot());
    auto [x, y] = batch(s);
    for (auto& t : reference.tensors()) t.mutable_grad().reset();
    reference.loss(x, y).backward();
    auto [xr, yr] = my_rows(s, *comm);
    opt.zero_grad();
    opt.backward(net.loss(xr, yr));
    double diff = 0;
    int compared = 0;
    for (auto& [name, t] : net.named) {
      if (!t.requires_grad()) continue;
      const at::Tensor& g = t.grad();
      EXPECT_TRUE(g.defined()) << name;
      if (!g.defined()) continue;
      diff = std::max(diff, (g - reference.p[name].grad()).abs().max().item<double>());
      ++compared;
    }
    EXPECT_EQ(compared, 5) << "step " << s;
    EXPECT_LE(diff, 1e-6) << "step " << s;
    EXPECT_TRUE(test::all_ranks(compared == 5 && diff <= 1e-6)) << "step " << s;
    opt.step();
  }
}

// A factory-built optimizer (any torch optimizer over the shard) follows LR changes made to the
// DistributedOptimizer's groups, like a native rule does.
TEST(TorchContract, FactoryBuiltOptimizerFollowsLrChanges) {
  auto comm = test::world();
  Mlp factory_net, native_net;
  DistributedOptimizer factory(
      factory_net.groups(),
      [](std::vector<at::Tensor> shard) {
        return std::make_unique<torch::optim::SGD>(shard, torch::optim::SGDOptions(0.1));
      },
      comm, zero(2, nullptr));
  DistributedOptimizer native(native_net.groups(), SGD(0.1), comm, zero(2, nullptr));
  EXPECT_EQ(factory.param_groups()[0].options().get_lr(), 0.1);
  train_generic(factory, factory_net, *comm);
  train_generic(native, native_net, *comm);
  EXPECT_LE(max_diff(factory_net.snapshot(), native_net.snapshot()), 1e-6);
  EXPECT_GT(max_diff(factory_net.snapshot(), Mlp().snapshot()), 1e-3);
}

}  // namespace
}  // namespace shardopt
