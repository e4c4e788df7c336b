/// \file
/// The torch optimizer contract for DistributedOptimizer's state, as ZeroRedundancyOptimizer keeps
/// it: consolidate_state_dict(to) gathers the full optimizer state onto one rank, whose
/// state_dict() (or torch::save(opt, file)) then holds what a torch::optim / torch.optim optimizer
/// of the same rule would hold; load_state_dict(state) (or torch::load(opt, file)) on every rank
/// takes such a full state, from shardopt or from a plain torch optimizer, and keeps its shard.
///
///   opt.consolidate_state_dict(0);                     // collective
///   if (comm->rank() == 0) torch::save(opt, "opt.pt"); // loads into torch::optim::AdamW too
///   torch::load(opt, "opt.pt");                        // every rank (collective)
///
/// Sharded checkpoints (shardopt/checkpoint.hpp) remain the way to save large runs: no rank ever
/// holds the full state there.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "shardopt/rules.hpp"

namespace shardopt {

/// The full optimizer state in torch's terms: the parameters given to the optimizer, by group in
/// the order given (frozen ones too, without state, as torch keeps them), each with its state
/// buffers under torch::optim's names ("exp_avg", "momentum_buffer", ...) and the shapes of the
/// parameter; each group's hyper-parameters.
struct OptimizerStateDict {
  /// One parameter: its name and its state buffers.
  struct Param {
    std::string name;  ///< the parameter's name
    /// Empty for a frozen parameter, and for every parameter before the first step.
    std::map<std::string, at::Tensor> state;
  };
  /// One param group: its hyper-parameters (a rule) and its parameters.
  struct Group {
    Rule rule;  ///< the group's hyper-parameters
    std::vector<Param> params;  ///< its parameters, in the order given
  };
  /// Steps taken (torch keeps one per parameter as "step"; shardopt's are all equal). SGD keeps no
  /// step in torch: a state with momentum buffers counts as step 1 when loaded.
  int64_t step = 0;
  std::vector<Group> groups;  ///< the param groups, in the order given
};

}  // namespace shardopt
