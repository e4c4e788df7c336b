/// \file
/// UnitPolicy: how stage 3 splits a model into units when no Units object is given (automatic
/// units). The parameters' names carry the module tree ("encoder.layers.3.linear1.weight") for
/// torch::nn::Module, torch::jit::Module and Python modules alike, so units are derived from them:
///
///   default:  every element of a module list / sequential (the path up to the first numbered
///             component: "encoder.layers.3", "bert.encoder.layer.11") is a unit; the remaining
///             parameters are grouped by the child of the deepest module holding such a list
///             ("bert.embeddings", "bert.pooler": "bert" holds "bert.encoder.layer"), else by
///             top-level child ("embeddings", "decoder", "cls"; parameters of the root module
///             itself form the group "").
///   patterns: each parameter whose name begins with a match of one of these ECMAScript regular
///             expressions (tried in order) is in the unit named by the matched text, e.g.
///             {R"(encoder\.layers\.\d+)", "embeddings"}; the others persist.
///
/// Persistence (Note [Persistent parameters] in src/engine/part_store.cpp): groups with fewer
/// than `persist_below` elements (DeepSpeed's stage3_param_persistence_threshold) persist,
/// smallest first, while their elements together stay within `persist_share` of the model's
/// (DeepSpeed's model_persistence_threshold, as a share): a persistent group is kept gathered for
/// good (its shard a view into it, so it costs what stage 2 costs for it, never more) and is
/// all-gathered once per step. The share bounds what persistence can take back from stage 3's
/// saving, so stage 3 stays below stage 2 on a model of many small layers. A parameter whose names
/// (a tied weight is reachable under several) fall into different units gets a part of its own,
/// gathered for each use. Torch-free (tests/unit/unit_policy_test.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardopt {

/// How stage 3 derives units from parameter names without a Units object (see the file's comment).
struct UnitPolicy {
  std::vector<std::string> patterns;  ///< empty: the default rule above
  int64_t persist_below = 100'000;    ///< elements; 0: every group is a unit
  double persist_share = 0.1;         ///< of the model's elements, for all persistent groups; 0..1

  /// Throws Error{InvalidArgument} naming an invalid pattern, a negative threshold or a share
  /// outside [0, 1].
  void validate() const;
};

/// The units `policy` derives from parameters named names[i] with numels[i] elements (one entry per
/// name; a tensor reachable under two names appears twice, with the same `tensor` id).
struct DerivedUnits {
  std::vector<std::string> names;           ///< unit names, in order of first appearance
  std::vector<std::vector<int>> members;    ///< per unit: indices into the given names
  std::vector<std::string> persistent;      ///< groups kept gathered for good
  int64_t persistent_numel = 0;             ///< their elements (tied tensors once)
  int64_t numel = 0;                        ///< the model's elements (tied tensors once)
};
/// The units `policy` derives from these names, sizes and tensor ids (the optimizer's own rule,
/// exposed for tests and tools).
DerivedUnits derive_units(const std::vector<std::string>& names,
                          const std::vector<int64_t>& numels, const std::vector<int64_t>& tensor,
                          const UnitPolicy& policy);

}  // namespace shardopt
