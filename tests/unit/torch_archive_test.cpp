// The optimizer-state readers of outside bytes in one process (issue 42's fuzz findings, each
// input kept under tests/fuzz/corpus as regress-*.hex): torch::save / torch::load of a
// consolidated DistributedOptimizer, and the torch.save files of full state dicts.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <sstream>
#include <string>

#include "fuzz/fuzz_model.hpp"
#include "shardopt/error.hpp"
#include "support/expect_error.hpp"

namespace shardopt {
namespace {

using fuzz::FuzzNet;

// The archive of a consolidated optimizer of `rule` (fuzz_rule) after two steps.
std::string saved_archive(int rule) {
  const FuzzNet net;
  auto opt = net.optimizer(rule, 0);
  net.train(*opt, 2);
  opt->consolidate_state_dict(0);
  std::ostringstream out;
  torch::save(*opt, out);
  return out.str();
}

// Every rule's hyper-parameters, bools included, come back from its own archive.
TEST(TorchArchive, EveryRuleRoundTrips) {
  for (int rule = 0; rule < 4; ++rule) {
    const FuzzNet net;
    auto opt = net.optimizer(rule, 1);
    std::istringstream in(saved_archive(rule));
    torch::load(*opt, in);
    net.train(*opt, 1);
    // SGD keeps no step in torch: a state with momentum buffers loads as step 1.
    EXPECT_EQ(opt->last_step().step, rule == 1 ? 2 : 3) << "rule " << rule;
  }
}

}  // namespace
}  // namespace shardopt
