// Automatic stage-3 units from parameter names (shardopt/unit_policy.hpp).
#include "shardopt/unit_policy.hpp"

#include <algorithm>
#include <cctype>
#include <map>
#include <regex>
#include <set>

#include "shardopt/error.hpp"

namespace shardopt {
namespace {

bool numbered(const std::string& component) {
  if (component.empty()) return false;
  for (char c : component) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

std::vector<std::string> split(const std::string& name) {
  std::vector<std::string> parts;
  for (size_t at = 0;;) {
    const size_t dot = name.find('.', at);
    parts.push_back(name.substr(at, dot == std::string::npos ? std::string::npos : dot - at));
    if (dot == std::string::npos) return parts;
    at = dot + 1;
  }
}

std::string join(const std::vector<std::string>& parts, size_t n) {
  std::string path = parts[0];
  for (size_t k = 1; k < n; ++k) path += "." + parts[k];
  return path;
}

// Where the first numbered module component after the first one is ("bert.encoder.layer.3.x.w":
// 3), or 0 when there is none.
size_t list_at(const std::vector<std::string>& parts) {
  for (size_t k = 1; k + 1 < parts.size(); ++k) {
    if (numbered(parts[k])) return k;
  }
  return 0;
}

// The default rule. A list element is a unit ("bert.encoder.layer.3"). Any other parameter is in
// the group of the child of the deepest module that holds a list ("bert" holds
// "bert.encoder.layer", so "bert.embeddings.word_embeddings.weight" is in "bert.embeddings" and
// "bert.pooler.dense.weight" in "bert.pooler"), else in its top-level child ("cls"), else, for the
// root module's own parameters, in "". Without the descent a model wrapped in one top-level
// module (Hugging Face's "bert.", "model.", "transformer.") would put everything but its layers
// in one group.
class DefaultRule {
 public:
  explicit DefaultRule(const std::vector<std::string>& names) {
    for (const auto& name : names) {
      const auto parts = split(name);
      for (size_t n = 1, k = list_at(parts); n <= k; ++n) holders_.insert(join(parts, n));
    }
  }
  std::string group(const std::string& name) const {
    const auto parts = split(name);
    if (parts.size() == 1) return "";  // the root module's own parameter
    if (const size_t k = list_at(parts); k > 0) return join(parts, k + 1);
    size_t n = parts.size() - 1;  // the module path's length
    while (n > 0 && holders_.count(join(parts, n)) == 0) --n;
    return join(parts, std::min(n + 1, parts.size() - 1));
  }

 private:
  std::set<std::string> holders_;  // modules on the path to a list, the lists included
};

}  // namespace

void UnitPolicy::validate() const {
  SHARDOPT_CHECK(persist_below >= 0, InvalidArgument,
                 "options: unit_policy.persist_below must be >= 0 elements, got {}", persist_below);
  SHARDOPT_CHECK(persist_share >= 0.0 && persist_share <= 1.0, InvalidArgument,
                 "options: unit_policy.persist_share must be in [0, 1] (a share of the model's "
                 "elements), got {}", persist_share);
  for (const auto& p : patterns) {
    try {
      std::regex re(p);
    } catch (const std::regex_error& e) {
      SHARDOPT_FAIL(InvalidArgument, "options: unit_policy pattern '{}' is not a valid regular "
                    "expression: {}", p, e.what());
    }
  }
}

DerivedUnits derive_units(const std::vector<std::string>& names,
                          const std::vector<int64_t>& numels, const std::vector<int64_t>& tensor,
                          const UnitPolicy& policy) {
  SHARDOPT_CHECK(names.size() == numels.size() && names.size() == tensor.size(), InvalidArgument,
                 "derive_units: {} names, {} numels, {} tensor ids", names.size(), numels.size(),
                 tensor.size());
  std::vector<std::regex> patterns;
  for (const auto& p : policy.patterns) patterns.emplace_back(p);
  const DefaultRule rule(patterns.empty() ? names : std::vector<std::string>{});
  std::vector<std::string> order;
  std::map<std::string, std::vector<int>> members;
  std::vector<int> no_group;
  for (size_t i = 0; i < names.size(); ++i) {
    std::string group;
    bool found = patterns.empty();
    if (found) {
      group = rule.group(names[i]);
    } else {
      for (const auto& re : patterns) {
        std::smatch m;
        if (std::regex_search(names[i], m, re, std::regex_constants::match_continuous)) {
          group = m.str(0);
          found = true;
          break;
        }
      }
    }
    if (!found) {
      no_group.push_back(static_cast<int>(i));
      continue;
    }
    auto [it, fresh] = members.emplace(group, std::vector<int>{});
    if (fresh) order.push_back(group);
    it->second.push_back(static_cast<int>(i));
  }
  DerivedUnits out;
  auto elements_of = [&](const std::vector<int>& list) {
    std::set<int64_t> seen;
    int64_t elements = 0;
    for (int i : list) {
      if (seen.insert(tensor[i]).second) elements += numels[i];
    }
    return elements;
  };
  std::vector<int> all(names.size());
  for (size_t i = 0; i < names.size(); ++i) all[i] = static_cast<int>(i);
  out.numel = elements_of(all);
  // Persistence: the groups under persist_below, smallest first (ties: first seen), while their
  // elements together stay within persist_share of the model's.
  std::vector<int64_t> elements(order.size());
  std::vector<size_t> by_size;
  for (size_t g = 0; g < order.size(); ++g) {
    elements[g] = elements_of(members[order[g]]);
    if (elements[g] < policy.persist_below) by_size.push_back(g);
  }
  std::stable_sort(by_size.begin(), by_size.end(),
                   [&](size_t a, size_t b) { return elements[a] < elements[b]; });
  const auto budget = static_cast<int64_t>(policy.persist_share * static_cast<double>(out.numel));
  int64_t persistent = elements_of(no_group);  // what no pattern names persists regardless
  std::vector<bool> persists(order.size(), false);
  for (size_t g : by_size) {
    if (persistent + elements[g] > budget) break;
    persistent += elements[g];
    persists[g] = true;
  }
  for (size_t g = 0; g < order.size(); ++g) {
    const std::string label = order[g].empty() ? std::string("(root)") : order[g];
    if (persists[g]) {
      out.persistent.push_back(label);
      continue;
    }
    out.names.push_back(label);
    out.members.push_back(members[order[g]]);
  }
  if (!no_group.empty()) out.persistent.push_back("(matched by no pattern)");
  out.persistent_numel = persistent;
  return out;
}

}  // namespace shardopt
