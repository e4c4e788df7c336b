// shardopt::recompute through DistributedOptimizer: with every block recomputed (called inside
// units->run, or as units declared to recompute), parameters after 5 steps are bitwise those of
// the plain model at stages 2 and 3. The loss sits directly on the last recomputed block, so the
// first gradients of each backward arrive inside a recomputation's nested backward.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "shardopt/optimizer.hpp"
#include "support/dist_env.hpp"
#include "support/dropout_blocks.hpp"

namespace shardopt {
namespace {

using test::DropoutBlocks;
using test::Mode;

std::map<std::string, at::Tensor> train(int stage, Mode mode, CommunicatorPtr comm) {
  DropoutBlocks net(4, 16, 32, mode);
  ZeroOptions zo;
  zo.stage = stage == 3 ? Stage::Parameters : Stage::Gradients;
  zo.units = net.units;
  zo.bucket_bytes = 4096;  // several buckets: some launch during the nested backward
  zo.timeout = std::chrono::seconds(60);
  std::vector<ParamGroup> groups(1);
  for (auto& [name, t] : net.named) groups[0].params.push_back({name, t});
  DistributedOptimizer opt(groups, AdamW(1e-2).weight_decay(0.01), comm, zo);
  at::manual_seed(100 + comm->rank());  // each rank its own data and dropout masks
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    auto x = at::randn({6, 16});
    opt.backward(net.forward(x, mode, /*with_units=*/true).pow(2).mean());
    opt.step();
  }
  opt.gather_full_parameters();
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : net.named) out[name] = t.detach().clone();
  return out;
}

TEST(RecomputeDist, ParametersAfterFiveStepsBitwiseThePlainRuns) {
  auto comm = test::world();
  for (int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const auto plain = train(stage, Mode::Plain, comm);
    const auto initial = DropoutBlocks(4, 16, 32).named;
    bool ok = true;
    for (Mode mode : {Mode::Direct, Mode::Declared}) {
      const auto again = train(stage, mode, comm);
      for (auto& [name, t] : plain) {
        const bool same = t.equal(again.at(name));
        EXPECT_TRUE(same) << name << " mode " << static_cast<int>(mode);
        ok = ok && same;
      }
    }
    // Training moved the parameters (the comparison is not between two untouched models).
    for (auto& [name, t] : initial) EXPECT_FALSE(t.detach().equal(plain.at(name))) << name;
    EXPECT_TRUE(test::all_ranks(ok));
  }
}

}  // namespace
}  // namespace shardopt
