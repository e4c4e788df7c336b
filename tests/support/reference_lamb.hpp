// Single-process LAMB on whole tensors: each tensor's trust ratio from its full norms. The
// definition sharded LAMB must reproduce; shared by the multi-rank parity tests.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <utility>
#include <vector>

#include "shardopt/rules.hpp"

namespace shardopt::test {

// (exp_avg, exp_avg_sq) per tensor, created at its first step.
using LambMoments = std::map<const void*, std::pair<at::Tensor, at::Tensor>>;

inline void reference_lamb_step(const std::vector<at::Tensor>& ps, const Lamb& r, int64_t step,
                                LambMoments& moments) {
  at::NoGradGuard no_grad;
  for (const auto& p : ps) {
    auto& [m, v] = moments[p.unsafeGetTensorImpl()];
    if (!m.defined()) {
      m = at::zeros_like(p);
      v = at::zeros_like(p);
    }
    const at::Tensor& g = p.grad();
    m.mul_(r.beta1()).add_(g, 1 - r.beta1());
    v.mul_(r.beta2()).addcmul_(g, g, 1 - r.beta2());
    at::Tensor u = (m / (1 - std::pow(r.beta1(), step))) /
                   ((v / (1 - std::pow(r.beta2(), step))).sqrt() + r.eps());
    if (r.weight_decay() != 0) u.add_(p, r.weight_decay());
    const double wn = p.norm().item<double>(), un = u.norm().item<double>();
    p.add_(u, -r.lr() * ((wn > 0 && un > 0) ? wn / un : 1.0));
  }
}

}  // namespace shardopt::test
