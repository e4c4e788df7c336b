// TEMPORARY (replaced by the rule table when merged): number of state buffers a rule keeps.
#pragma once

#include <variant>

#include "shardopt/rules.hpp"

namespace shardopt::detail {

inline int state_count(const Rule& rule) {
  struct {
    int operator()(const Adam& r) const { return r.amsgrad() ? 3 : 2; }
    int operator()(const AdamW& r) const { return r.amsgrad() ? 3 : 2; }
    int operator()(const SGD& r) const { return r.momentum() != 0.0 ? 1 : 0; }
    int operator()(const Adagrad&) const { return 1; }
    int operator()(const RMSprop& r) const {
      return 1 + (r.momentum() > 0.0 ? 1 : 0) + (r.centered() ? 1 : 0);
    }
    int operator()(const Lamb&) const { return 2; }
  } count;
  return std::visit(count, rule);
}

}  // namespace shardopt::detail
