// Model check: collecting and validating the parameters, and the cross-rank model comparison.
#include "engine/model_check.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <unordered_map>

#include "shardopt/error.hpp"

namespace shardopt::detail {
namespace {

// FNV-1a: a digest of parameter descriptions that is the same on every platform.
int64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return static_cast<int64_t>(h & 0x7fffffffffffffffull);
}

// Each parameter's unit: the first unit declaring it; declared by two units, or by none, it
// belongs to the root unit.
void assign_units(CollectedModel& m, const Units& units) {
  m.root_unit = units.size();
  std::unordered_map<const c10::TensorImpl*, int> unit_of;
  for (int u = 0; u < m.root_unit; ++u) {
    for (const auto& t : units.parameters(u)) {
      auto [it, fresh] = unit_of.emplace(t.unsafeGetTensorImpl(), u);
      if (!fresh && it->second != u) it->second = m.root_unit;  // shared by two units
    }
  }
  for (auto& p : m.params) {
    auto it = unit_of.find(p.tensor.unsafeGetTensorImpl());
    p.unit = it == unit_of.end() ? m.root_unit : it->second;
  }
}

}  // namespace

at::ScalarType compute_dtype(Precision precision) {
  return precision == Precision::BF16 ? at::kBFloat16
         : precision == Precision::FP16 ? at::kHalf : at::kFloat;
}

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
  if (units) assign_units(m, *units);
  // Layout order: by group, (unit,) then reverse registration order (see Note [Flat layout]).
  std::stable_sort(params.begin(), params.end(), [](const ModelParam& a, const ModelParam& b) {
    if (a.group != b.group) return a.group < b.group;
    if (a.unit != b.unit) return a.unit < b.unit;
    return a.order > b.order;
  });
  return m;
}

void verify_same_model(const std::vector<ModelParam>& params, bool per_unit, Communicator& comm,
                       Duration timeout) {
  const int world = comm.size();
  if (world == 1) return;
  std::vector<std::string> desc;
  for (const auto& p : params) {
    desc.push_back(fmt::format("'{}' {} (group {}{})", p.name, describe(p.tensor), p.group,
                               per_unit ? fmt::format(", unit {}", p.unit) : std::string()));
  }
  at::Tensor count = at::full({1}, static_cast<int64_t>(desc.size()), at::kLong);
  at::Tensor counts = at::empty({world}, at::kLong);
  comm.all_gather(count, counts, true)->wait(timeout);
  const int64_t width = counts.max().item<int64_t>() + 1;
  at::Tensor mine = at::zeros({width}, at::kLong);
  auto* m = mine.data_ptr<int64_t>();
  m[0] = static_cast<int64_t>(desc.size());
  for (size_t i = 0; i < desc.size(); ++i) m[i + 1] = fnv1a(desc[i]);
  at::Tensor all = at::empty({world * width}, at::kLong);
  comm.all_gather(mine, all, true)->wait(timeout);
  auto* a = all.data_ptr<int64_t>();
  int64_t first_bad = -1;
  for (int64_t i = 1; i < width && first_bad < 0; ++i) {
    for (int r = 1; r < world; ++r) {
      if (a[r * width + i] != a[i]) first_bad = i - 1;
    }
  }
  if (first_bad < 0) {
    for (int r = 1; r < world; ++r) {
      if (a[r * width] != a[0]) first_bad = std::min(a[r * width], a[0]);
    }
  }
  if (first_bad < 0) return;
  // Everyone agrees on first_bad: exchange the descriptions of that parameter.
  constexpr int64_t kText = 200;
  std::string text = first_bad < static_cast<int64_t>(desc.size())
                         ? desc[first_bad] : std::string("no such parameter");
  text.resize(kText, '\0');
  at::Tensor line = at::from_blob(text.data(), {kText}, at::kByte).clone();
  at::Tensor lines = at::empty({world * kText}, at::kByte);
  comm.all_gather(line, lines, true)->wait(timeout);
  std::string report;
  for (int r = 0; r < world; ++r) {
    std::string s(reinterpret_cast<const char*>(lines.data_ptr<uint8_t>()) + r * kText, kText);
    report += fmt::format("\n  rank {}: {} trainable parameters, #{} is {}", r, a[r * width],
                          first_bad, s.c_str());
  }
  SHARDOPT_FAIL(Mismatch,
                "optimizer: the model differs across ranks at trainable parameter #{} (in "
                "layout order); every rank must build the same model:{}",
                first_bad, report);
}

}  // namespace shardopt::detail
