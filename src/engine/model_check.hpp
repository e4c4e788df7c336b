// Model check: what the optimizer is given, validated and put in layout order (Note [Flat
// layout] in flat_state.hpp), and the check that every rank was given the same model.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "shardopt/comm.hpp"
#include "shardopt/optimizer_types.hpp"
#include "shardopt/options.hpp"
#include "shardopt/rules.hpp"
#include "shardopt/units.hpp"

namespace shardopt::detail {

struct ModelParam {
  std::string name;
  at::Tensor tensor;
  int group = 0;
  int part = 0;       // per-part plans: its part (Note [Stage 3 units] in src/engine/engine.cpp)
  int64_t order = 0;  // position in the parameter lists given (checkpoint manifests use it)
};

struct CollectedModel {
  std::vector<ModelParam> params;  // trainable, tied ones once, in layout order
  std::vector<Rule> group_rules;   // each group's rule (its lr / weight decay applied)
  std::vector<std::vector<at::Tensor>> torch_groups;  // the torch param groups' tensors
  // Per-part plans: parameters are gathered in parts. Part u < declared units holds what only
  // declared unit u declares; then one part per set of two or more units sharing parameters;
  // the last part, root_part, holds the parameters no unit declares.
  int root_part = 0;
  std::vector<std::vector<int>> unit_parts;  // declared unit -> the parts it needs, own first
  std::vector<std::string> loose_names;      // the parameters in no unit
};

// Whether the first trainable parameter lives in host memory (decides where offload moves to).
bool first_trainable_on_host(const std::vector<ParamGroup>& groups);

// Validates groups and parameters (names in errors) and orders them: by group, part, then reverse
// registration order. `units`: the declared units when parameters are gathered per part, else
// null (everything in part 0).
CollectedModel collect_model(std::vector<ParamGroup> groups, const Rule& rule, bool has_factory,
                             Precision precision, const Units* units);

// Collective: ranks compare (name, shape, dtype, group, part) of every parameter; on a mismatch
// every rank throws Error{Mismatch} naming the first differing parameter and each rank's view.
void verify_same_model(const std::vector<ModelParam>& params, bool per_part, Communicator& comm,
                       Duration timeout);

// How a released parameter's error names the units that gather each part (release_guard.hpp).
std::vector<std::string> part_labels(const CollectedModel& model, const Units& units);

}  // namespace shardopt::detail
