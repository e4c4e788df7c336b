// torch.optim.Muon (+ torch.optim.AdamW for the parameters Muon does not take) ported op for op
// to ATen, on whole tensors in one process: the definition sharded Muon must reproduce (held to
// torch's own values by MuonReference.MatchesTorchGolden, tests/support/muon_golden.hpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: not reached through ATen.h on torch 2.6

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "shardopt/rules.hpp"

namespace shardopt::test {

struct MuonTensorState {
  at::Tensor momentum_buffer;      // Muon's matrices
  at::Tensor exp_avg, exp_avg_sq;  // AdamW's parameters
};
using MuonStates = std::map<const void*, MuonTensorState>;

// torch/optim/_muon.py's _zeropower_via_newtonschulz, its cast to `dtype`.
inline at::Tensor reference_newton_schulz(const at::Tensor& grad, const Muon& r,
                                          at::ScalarType dtype) {
  at::Tensor x = grad.to(dtype, /*non_blocking=*/false, /*copy=*/true);
  if (grad.size(0) > grad.size(1)) x = x.t();
  x.div_(at::linalg_vector_norm(x, 2).clamp(c10::optional<at::Scalar>(r.eps())));
  for (int k = 0; k < static_cast<int>(r.ns_steps()); ++k) {
    at::Tensor gram = at::matmul(x, x.t());
    at::Tensor gram_update = at::addmm(gram, gram, gram, r.ns_b(), r.ns_c());
    x = at::addmm(x, gram_update, x, r.ns_a());
  }
  if (grad.size(0) > grad.size(1)) x = x.t();
  return x;
}

inline at::ScalarType reference_ns_dtype(const Muon& r) {
  return r.ns_dtype() == 64 ? at::kDouble : r.ns_dtype() == 32 ? at::kFloat : at::kBFloat16;
}

// One step of `params` (one group, rule `r`, whose .grad are set), step numbers per tensor.
inline void reference_muon_step(const std::vector<at::Tensor>& params, const Muon& r,
                                MuonStates& states, int64_t step) {
  at::NoGradGuard no_grad;
  for (const at::Tensor& p_const : params) {
    at::Tensor p = p_const;
    const at::Tensor& g = p.grad();
    MuonTensorState& st = states[p.unsafeGetTensorImpl()];
    if (p.dim() == 2 && r.use_muon()) {
      // _single_tensor_muon
      if (!st.momentum_buffer.defined()) st.momentum_buffer = at::zeros_like(g);
      at::Tensor& buf = st.momentum_buffer;
      buf.lerp_(g, 1 - r.momentum());
      at::Tensor update = r.nesterov() ? g.lerp(buf, r.momentum()) : buf;
      update = reference_newton_schulz(update, r, reference_ns_dtype(r));
      const double a = static_cast<double>(p.size(0)), b = static_cast<double>(p.size(1));
      const double ratio = r.adjust_lr_fn() == Muon::kMatchRmsAdamW ? 0.2 * std::sqrt(std::max(a, b))
                           : r.adjust_lr_fn() == Muon::kSpectralUnclamped ? std::sqrt(a / b)
                                                                          : std::sqrt(std::max(1.0, a / b));
      p.mul_(1 - r.lr() * r.weight_decay());
      p.add_(update, -r.lr() * ratio);
      continue;
    }
    // torch.optim.AdamW's _single_tensor_adam (decoupled weight decay).
    if (!st.exp_avg.defined()) {
      st.exp_avg = at::zeros_like(p);
      st.exp_avg_sq = at::zeros_like(p);
    }
    const double beta1 = r.adamw_beta1(), beta2 = r.adamw_beta2();
    if (r.weight_decay() != 0) p.mul_(1 - r.lr() * r.weight_decay());
    st.exp_avg.lerp_(g, 1 - beta1);
    st.exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2);
    const double bias_correction1 = 1 - std::pow(beta1, static_cast<double>(step));
    const double bias_correction2 = 1 - std::pow(beta2, static_cast<double>(step));
    const double step_size = r.lr() / bias_correction1;
    const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
    at::Tensor denom = (st.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(r.adamw_eps());
    p.addcdiv_(st.exp_avg, denom, -step_size);
  }
}

}  // namespace shardopt::test
