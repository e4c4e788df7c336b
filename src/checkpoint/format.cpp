// Checkpoint names and codecs: dtype names and the rules' JSON codec, written once over each
// rule's field list (Note [One place per rule] in shardopt/rules.hpp).
#include "checkpoint/format.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include "shardopt/detail/rule_traits.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail {

std::string dump(const json& j, int indent) {
  return j.dump(indent, ' ', false, json::error_handler_t::replace);
}

namespace {
struct DtypeName {
  at::ScalarType type;
  const char* name;
};
constexpr DtypeName kDtypeNames[] = {
    {at::kFloat, "float32"}, {at::kDouble, "float64"}, {at::kHalf, "float16"},
    {at::kBFloat16, "bfloat16"}, {at::kLong, "int64"}, {at::kInt, "int32"},
    {at::kShort, "int16"}, {at::kChar, "int8"}, {at::kByte, "uint8"}, {at::kBool, "bool"}};
}  // namespace

std::string dtype_name(at::ScalarType t) {
  for (const auto& d : kDtypeNames) {
    if (d.type == t) return d.name;
  }
  SHARDOPT_FAIL(Unsupported, "checkpoint: tensors of dtype {} cannot be stored", c10::toString(t));
}

at::ScalarType dtype_from_name(const std::string& name, const std::string& where) {
  for (const auto& d : kDtypeNames) {
    if (name == d.name) return d.type;
  }
  SHARDOPT_FAIL(Checkpoint, "checkpoint: {}: unknown dtype '{}'", where, name);
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

int64_t checked_add(int64_t a, int64_t b, const std::string& where) {
  int64_t out = 0;
  SHARDOPT_CHECK(a >= 0 && b >= 0 && !__builtin_add_overflow(a, b, &out), Checkpoint,
                 "checkpoint: {}: {} + {} is negative or past 2^63", where, a, b);
  return out;
}

int64_t checked_mul(int64_t a, int64_t b, const std::string& where) {
  int64_t out = 0;
  SHARDOPT_CHECK(a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, &out), Checkpoint,
                 "checkpoint: {}: {} * {} is negative or past 2^63", where, a, b);
  return out;
}

int64_t checked_step_count(int64_t step, const std::string& where) {
  constexpr int64_t kMaxStepCount = int64_t{1} << 53;
  SHARDOPT_CHECK(step >= 0 && step <= kMaxStepCount, Checkpoint,
                 "checkpoint: {}: step count {} is outside 0..2^53", where, step);
  return step;
}

int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& where) {
  int64_t n = 1;
  for (int64_t s : shape) {
    SHARDOPT_CHECK(s >= 0 && !__builtin_mul_overflow(n, s, &n), Checkpoint,
                   "checkpoint: {}: shape {} has a negative dimension or more than 2^63 elements",
                   where, shape_text(shape));
  }
  return n;
}

}  // namespace shardopt::detail
