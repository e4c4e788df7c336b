// Checkpoint names and codecs: dtype names and the rules' JSON codec, written once over each
// rule's field list (Note [One place per rule] in shardopt/rules.hpp).
#include "checkpoint/format.hpp"

#include <fmt/format.h>

#include <map>

#include "shardopt/detail/rule_traits.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail {

std::string dump(const json& j, int indent) {
  return j.dump(indent, ' ', false, json::error_handler_t::replace);
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    case at::kLong:
      return "int64";
    case at::kInt:
      return "int32";
    case at::kShort:
      return "int16";
    case at::kChar:
      return "int8";
    case at::kByte:
      return "uint8";
    case at::kBool:
      return "bool";
    default:
      break;
  }
  SHARDOPT_FAIL(Unsupported, "checkpoint: tensors of dtype {} cannot be stored", c10::toString(t));
}

at::ScalarType dtype_from_name(const std::string& name, const std::string& where) {
  static const std::map<std::string, at::ScalarType> kTypes = {
      {"float32", at::kFloat},     {"float64", at::kDouble}, {"float16", at::kHalf},
      {"bfloat16", at::kBFloat16}, {"int64", at::kLong},     {"int32", at::kInt},
      {"int16", at::kShort},       {"int8", at::kChar},      {"uint8", at::kByte},
      {"bool", at::kBool}};
  auto it = kTypes.find(name);
  SHARDOPT_CHECK(it != kTypes.end(), Checkpoint, "checkpoint: {}: unknown dtype '{}'", where, name);
  return it->second;
}

json rule_to_json(const Rule& rule) {
  json j = json::object();
  std::visit(
      [&](const auto& r) {
        using R = std::decay_t<decltype(r)>;
        R::fields(r, [&](const Field& f, const auto& value) { j[f.name] = value; });
      },
      rule);
  j["rule"] = rule_name(rule);
  return j;
}

Rule rule_from_json(const json& j) {
  const std::string name = j.at("rule").get<std::string>();
  Rule rule;
  const bool known = with_rule_named(name, [&](auto type) {
    using R = typename decltype(type)::type;
    R r = blank_rule<R>();
    R::fields(r, [&](const Field& f, auto& value) {
      value = j.at(f.name).template get<std::decay_t<decltype(value)>>();
    });
    rule = r;
  });
  SHARDOPT_CHECK(known, Checkpoint, "checkpoint: unknown optimizer rule '{}'", name);
  return rule;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

}  // namespace shardopt::detail
