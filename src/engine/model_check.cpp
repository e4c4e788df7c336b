// Model check: collecting and validating the parameters, the cross-rank model comparison, and
// the names of stage 3's parts.
#include "engine/model_check.hpp"

#include <ATen/ATen.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <unordered_map>

#include "comm/gather_strings.hpp"
#include "engine/placement.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail {
namespace {

// Each parameter's part (CollectedModel::root_part, Note [Stage 3 units]).
void assign_parts(CollectedModel& m, const Units& units) {
  const int declared = units.size();
  std::unordered_map<const c10::TensorImpl*, std::vector<int>> declared_by;
  for (int u = 0; u < declared; ++u) {
    for (const auto& t : units.parameters(u)) {
      auto& list = declared_by[t.unsafeGetTensorImpl()];
      if (list.empty() || list.back() != u) list.push_back(u);
    }
  }
  m.unit_parts.assign(declared, {});
  for (int u = 0; u < declared; ++u) m.unit_parts[u].push_back(u);
  std::map<std::vector<int>, int> shared;  // set of declaring units -> its part
  std::vector<int> part_of(m.params.size(), -1);
  for (size_t i = 0; i < m.params.size(); ++i) {
    auto it = declared_by.find(m.params[i].tensor.unsafeGetTensorImpl());
    if (it == declared_by.end()) continue;
    std::vector<int> set = it->second;
    std::sort(set.begin(), set.end());
    set.erase(std::unique(set.begin(), set.end()), set.end());
    if (set.size() == 1) {
      part_of[i] = set.front();
      continue;
    }
    auto [pos, fresh] = shared.emplace(set, declared + static_cast<int>(shared.size()));
    if (fresh) {
      for (int u : set) m.unit_parts[u].push_back(pos->second);
    }
    part_of[i] = pos->second;
  }
  m.root_part = declared + static_cast<int>(shared.size());
  for (size_t i = 0; i < m.params.size(); ++i) {
    m.params[i].part = part_of[i] >= 0 ? part_of[i] : m.root_part;
    if (part_of[i] < 0) m.loose_names.push_back(m.params[i].name);
  }
}

}  // namespace

bool first_trainable_on_host(const std::vector<ParamGroup>& groups) {
  for (const auto& g : groups) {
    for (const auto& np : g.params) {
      if (np.tensor.defined() && np.tensor.requires_grad()) return np.tensor.is_cpu();
    }
  }
  return true;
}

CollectedModel collect_model(std::vector<ParamGroup> groups, const Rule& rule, bool has_factory,
                             Precision precision, const Units* units) {
  SHARDOPT_CHECK(!groups.empty(), InvalidArgument, "optimizer: no parameter groups given");
  CollectedModel m;
  std::unordered_map<const c10::TensorImpl*, std::pair<std::string, int>> seen;  // name, group
  // Checkpoints key parameters by name (shardopt/checkpoint.hpp): a name given to two different
  // tensors, or an empty one, would save a checkpoint that can never be loaded.
  std::unordered_map<std::string, const c10::TensorImpl*> names;
  int64_t order = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    Rule group_rule = rule;
    if (groups[g].lr) set_rule_lr(group_rule, *groups[g].lr);
    if (groups[g].weight_decay) set_rule_weight_decay(group_rule, *groups[g].weight_decay);
    SHARDOPT_CHECK(!has_factory || (!groups[g].lr && !groups[g].weight_decay), InvalidArgument,
                   "optimizer: group {} overrides lr/weight_decay, which a factory-built "
                   "optimizer cannot see; give the factory's optimizer its own groups", g);
    m.group_rules.push_back(group_rule);
    m.torch_groups.emplace_back();
    for (auto& np : groups[g].params) {
      SHARDOPT_CHECK(np.tensor.defined(), InvalidArgument,
                     "optimizer: parameter '{}' is an undefined tensor", np.name);
      ++order;
      if (!np.tensor.requires_grad()) continue;  // frozen: not ours to shard
      SHARDOPT_CHECK(!np.name.empty(), InvalidArgument,
                     "optimizer: trainable parameter #{} has an empty name; checkpoints key "
                     "parameters by name", order - 1);
      auto [named, new_name] = names.emplace(np.name, np.tensor.unsafeGetTensorImpl());
      SHARDOPT_CHECK(new_name || named->second == np.tensor.unsafeGetTensorImpl(), InvalidArgument,
                     "optimizer: parameter name '{}' is given to two different tensors; names "
                     "must be unique (checkpoints key parameters by name, so such a checkpoint "
                     "could never be loaded)", np.name);
      auto [it, fresh] = seen.emplace(np.tensor.unsafeGetTensorImpl(),
                                      std::make_pair(np.name, static_cast<int>(g)));
      if (!fresh) {
        SHARDOPT_CHECK(it->second.second == static_cast<int>(g), InvalidArgument,
                       "optimizer: parameter '{}' is the same tensor as '{}' but sits in another "
                       "parameter group", np.name, it->second.first);
        continue;  // tied: one copy in the layout
      }
      SHARDOPT_CHECK(np.tensor.is_leaf(), InvalidArgument,
                     "optimizer: parameter '{}' is not a leaf tensor", np.name);
      m.params.push_back({np.name, np.tensor, static_cast<int>(g), 0, order});
      m.torch_groups.back().push_back(np.tensor);
    }
  }
  auto& params = m.params;
  SHARDOPT_CHECK(!params.empty(), InvalidArgument,
                 "optimizer: no trainable parameters (all are frozen or the list is empty)");
  const auto& first = params.front().tensor;
  for (const auto& p : params) {
    SHARDOPT_CHECK(p.tensor.scalar_type() == first.scalar_type() &&
                       p.tensor.device() == first.device(),
                   InvalidArgument,
                   "optimizer: all trainable parameters must share dtype and device; '{}' is {} "
                   "but '{}' is {}", p.name, describe(p.tensor), params.front().name,
                   describe(first));
  }
  const bool mixed = precision != Precision::FP32;
  const bool compute_typed = mixed && first.scalar_type() == compute_dtype(precision);
  SHARDOPT_CHECK(first.scalar_type() == at::kFloat || first.scalar_type() == at::kDouble ||
                     compute_typed,
                 InvalidArgument,
                 "optimizer: parameters must be float32 or float64{}, '{}' is {}",
                 mixed ? fmt::format(" (or {} with precision {})",
                                     c10::toString(compute_dtype(precision)), to_string(precision))
                       : std::string(),
                 params.front().name, describe(first));
  SHARDOPT_CHECK(!mixed || first.scalar_type() != at::kDouble, InvalidArgument,
                 "optimizer: precision {} needs float32 parameters (the master copy is fp32), "
                 "'{}' is {}", to_string(precision), params.front().name, describe(first));
  if (units) assign_parts(m, *units);
  // Layout order: by group, (part,) then reverse registration order (see Note [Flat layout] in flat_state.hpp).
  std::stable_sort(params.begin(), params.end(), [](const ModelParam& a, const ModelParam& b) {
    if (a.group != b.group) return a.group < b.group;
    if (a.part != b.part) return a.part < b.part;
    return a.order > b.order;
  });
  return m;
}

void verify_same_model(const std::vector<ModelParam>& params, bool per_part, Communicator& comm,
                       Duration timeout) {
  const int world = comm.size();
  if (world == 1) return;
  std::string mine;
  for (const auto& p : params) {
    mine += fmt::format("'{}' {} (group {}{})\n", p.name, describe(p.tensor), p.group,
                        per_part ? fmt::format(", part {}", p.part) : std::string());
  }
  const auto all = all_gather_strings(comm, mine, timeout);
  if (std::all_of(all.begin(), all.end(), [&](const std::string& s) { return s == all[0]; })) {
    return;
  }
  std::vector<std::vector<std::string>> lines(world);
  size_t longest = 0;
  for (int r = 0; r < world; ++r) {
    std::istringstream in(all[r]);
    for (std::string l; std::getline(in, l);) lines[r].push_back(l);
    longest = std::max(longest, lines[r].size());
  }
  auto line = [&](int r, size_t i) {
    return i < lines[r].size() ? lines[r][i] : std::string("no such parameter");
  };
  auto same_at = [&](size_t i) {
    for (int r = 1; r < world; ++r) {
      if (line(r, i) != line(0, i)) return false;
    }
    return true;
  };
  size_t first_bad = 0;
  while (first_bad < longest && same_at(first_bad)) ++first_bad;
  std::string report;
  for (int r = 0; r < world; ++r) {
    report += fmt::format("\n  rank {}: {} trainable parameters, #{} is {}", r, lines[r].size(),
                          first_bad, line(r, first_bad));
  }
  SHARDOPT_FAIL(Mismatch,
                "optimizer: the model differs across ranks at trainable parameter #{} (in "
                "layout order); every rank must build the same model:{}",
                first_bad, report);
}

// "unit 'layer'", "units 'embeddings', 'heads'" for a shared part, "no unit" for the root part.
std::vector<std::string> part_labels(const CollectedModel& model, const Units& units) {
  std::vector<std::vector<std::string>> users(model.root_part + 1);
  for (size_t u = 0; u < model.unit_parts.size(); ++u) {
    for (int part : model.unit_parts[u]) {
      users[part].push_back(fmt::format("'{}'", units.name(static_cast<int>(u))));
    }
  }
  std::vector<std::string> labels;
  for (const auto& names : users) {
    labels.push_back(names.empty()       ? std::string("no unit: gathered from zero_grad() to step()")
                     : names.size() == 1 ? fmt::format("unit {}", names[0])
                                         : fmt::format("units {}", fmt::join(names, ", ")));
  }
  return labels;
}

}  // namespace shardopt::detail
