// Automatic stage-3 units from parameter names (shardopt/unit_policy.hpp).
#include "shardopt/unit_policy.hpp"

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

// The default rule: the path up to the first numbered component after the first, else the
// top-level child ("" for the root module's own parameters).
std::string default_group(const std::string& name) {
  std::vector<std::string> parts;
  for (size_t at = 0;;) {
    const size_t dot = name.find('.', at);
    parts.push_back(name.substr(at, dot == std::string::npos ? std::string::npos : dot - at));
    if (dot == std::string::npos) break;
    at = dot + 1;
  }
  if (parts.size() == 1) return "";  // the root module's own parameter
  std::string path = parts[0];
  for (size_t k = 1; k + 1 < parts.size(); ++k) {
    path += "." + parts[k];
    if (numbered(parts[k])) return path;
  }
  return parts[0];
}

}  // namespace

void UnitPolicy::validate() const {
  SHARDOPT_CHECK(persist_below >= 0, InvalidArgument,
                 "options: unit_policy.persist_below must be >= 0 elements, got {}", persist_below);
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
  std::vector<std::string> order;
  std::map<std::string, std::vector<int>> members;
  std::vector<int> no_group;
  for (size_t i = 0; i < names.size(); ++i) {
    std::string group;
    bool found = patterns.empty();
    if (found) {
      group = default_group(names[i]);
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
  for (const auto& group : order) {
    const auto& list = members[group];
    std::set<int64_t> seen;
    int64_t elements = 0;
    for (int i : list) {
      if (seen.insert(tensor[i]).second) elements += numels[i];
    }
    const std::string label = group.empty() ? std::string("(root)") : group;
    if (elements < policy.persist_below) {
      out.persistent.push_back(label);
      continue;
    }
    out.names.push_back(label);
    out.members.push_back(list);
  }
  if (!no_group.empty()) out.persistent.push_back("(matched by no pattern)");
  return out;
}

}  // namespace shardopt
