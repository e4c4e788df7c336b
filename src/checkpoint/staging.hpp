// What a load stages before it touches the optimizer: the checks that a checkpoint or full state
// fits this optimizer (model, rule, parameter shapes), this rank's staged shard of parameters and
// state, and the commit that replaces the optimizer's owned slices. Internal to src/checkpoint/.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/ordered_dict.h>

#include <map>
#include <string>
#include <vector>

#include "checkpoint/manifest.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/detail/state_sections.hpp"

namespace shardopt::detail {

// Native rules only: a factory-built optimizer keeps its state inside torch.
void check_checkpointable(ShardAccess& a);
// The same for the torch state-dict functions (`what`: the one called); state_dict.cpp.
void check_has_torch_state(ShardAccess& a, const char* what);
// The state buffer names of the optimizer's rule (as many as the engine keeps).
std::vector<std::string> optimizer_state_names(ShardAccess& a);

// Paths that hand the state out per element (torch state dicts, full states) refuse a rule
// whose state is not (Note [Quantised state in checkpoints]); `what`: the function called.
void check_elementwise_state(const std::string& rule, const char* what);

// A rank's sections of the optimizer state buffers (Note [Quantised state in checkpoints]):
// where each element's entries are, and each section's dtype.
struct StateSections {
  std::vector<SectionMap> maps;
  std::vector<at::ScalarType> dtypes;
  // Bucket `bucket`'s slice of section k: its first entry and entry count.
  std::pair<int64_t, int64_t> slice(const FlatLayout& layout, int k, int bucket) const;
};
// This rank's, under the optimizer's layout and rule.
StateSections state_sections(ShardAccess& a);
// Saved rank `rank`'s, from the manifest's piece table, for this optimizer's rule.
StateSections saved_state_sections(ShardAccess& a, const Manifest& m, int rank);
// Shard file `f` holds state sections of the dtype and length `s` says (names: the buffers').
void check_state_sections(const Manifest& m, const ShardFile& f,
                          const std::vector<std::string>& names, const StateSections& s);

// This rank's shard of parameters and state, staged before it replaces the optimizer's.
struct Staging {
  at::Tensor param;
  std::vector<at::Tensor> state;  // section k: sections.maps[k].size() entries
  StateSections sections;
};

// Starts from the current owned slices, so padding and anything not loaded keep their values.
Staging stage_current(ShardAccess& a, int states);
// Replaces the optimizer's owned slices with the staged ones. Cannot fail on user input.
void commit(ShardAccess& a, const Staging& s);

// The checkpoint holds exactly the optimizer's parameters, with the same shapes.
void check_same_model(ShardAccess& a, const Manifest& m);
// ... and the state of the same rule, with as many parameter groups.
void check_same_optimizer(ShardAccess& a, const Manifest& m,
                          const std::vector<std::string>& names);

// The stored values of the model's tensors that LoadOptions::module_state names (world rank 0's,
// kept in shard file 0 as trainer tensors "module/<name>"), checked against their targets;
// save_load.cpp.
std::map<std::string, at::Tensor> stage_module_state(
    const Manifest& m, const std::map<std::string, at::Tensor>& targets);

// Note [Tensors from files]: torch's unpickler rebuilds a tensor from the sizes, strides and
// storage offset a file states without checking them against the storage it read, so a crafted
// torch.save or torch::save file makes a copy read past the storage. Every tensor our readers
// take from such a file passes this first: a dense (strided, not quantized) tensor with
// non-negative strides and every element inside its storage. Error{Checkpoint} starting with
// `what` ("<module>: <file>: tensor '<name>'").
void check_tensor_from_file(const at::Tensor& t, const std::string& what);

// The model's parameters in a full state: index in the layout -> tensor (checked).
std::vector<at::Tensor> match_full_params(ShardAccess& a,
                                          const torch::OrderedDict<std::string, at::Tensor>& params,
                                          const std::string& what);
// Copies this rank's owned elements of each parameter from full tensors into staging.
void stage_from_full(ShardAccess& a, at::Tensor& staging, const std::vector<at::Tensor>& full);

}  // namespace shardopt::detail
