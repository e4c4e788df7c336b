// torch.optim.Adafactor's single-tensor step (torch/optim/_adafactor.py, torch >= 2.5) op for op
// in ATen, so every platform's tests have the reference, whatever its torch version; checked
// against torch.optim.Adafactor itself by python_bindings/tests/test_adafactor.py.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <vector>

#include "shardopt/rules.hpp"

namespace shardopt::test {

struct AdafactorTensorState {
  int64_t step = 0;
  at::Tensor row_var, col_var, variance;
};
using AdafactorStates = std::map<const void*, AdafactorTensorState>;

inline void reference_adafactor_step(const std::vector<at::Tensor>& ps, const Adafactor& r,
                                     AdafactorStates& states) {
  at::NoGradGuard no_grad;
  for (at::Tensor p : ps) {
    if (!p.grad().defined()) continue;
    auto& st = states[p.unsafeGetTensorImpl()];
    const at::Tensor grad = r.maximize() ? -p.grad() : p.grad();
    if (st.step == 0) {
      if (grad.dim() > 1) {
        auto row_shape = grad.sizes().vec(), col_shape = grad.sizes().vec();
        row_shape.back() = 1;
        col_shape[col_shape.size() - 2] = 1;
        st.row_var = at::zeros(row_shape, grad.options());
        st.col_var = at::zeros(col_shape, grad.options());
      } else {
        st.variance = at::zeros_like(grad);
      }
    }
    const double eps1 = r.eps1() >= 0 ? r.eps1()
                        : p.scalar_type() == at::kDouble ? std::numeric_limits<double>::epsilon()
                                                         : std::numeric_limits<float>::epsilon();
    st.step += 1;
    const double step = static_cast<double>(st.step);
    const double one_minus_beta2_t = std::pow(step, r.beta2_decay());
    const double rho_t = std::min(r.lr(), 1 / std::pow(step, 0.5));
    const double alpha =
        std::max(r.eps2(), p.norm(2).item<double>() / std::pow(p.numel(), 0.5)) * rho_t;
    if (r.weight_decay() != 0) p.mul_(1 - r.lr() * r.weight_decay());
    at::Tensor var_estimate;
    if (grad.dim() > 1) {
      at::Tensor row_mean =
          at::linalg_vector_norm(grad, 2, {-1}, true).square_().div_(grad.size(-1));
      st.row_var.lerp_(row_mean, one_minus_beta2_t);
      at::Tensor col_mean =
          at::linalg_vector_norm(grad, 2, {-2}, true).square_().div_(grad.size(-2));
      st.col_var.lerp_(col_mean, one_minus_beta2_t);
      var_estimate = at::matmul(st.row_var, st.col_var);
      var_estimate.div_(st.row_var.mean({-2}, true).clamp_(eps1));
    } else {
      at::Tensor grad_squared = grad * grad;
      st.variance.lerp_(grad_squared, one_minus_beta2_t);
      var_estimate = st.variance.clone();
    }
    at::Tensor update = var_estimate.clamp_(eps1 * eps1).rsqrt_();
    update.mul_(grad);
    const double denom = std::max(
        1.0, update.norm(2).item<double>() / (std::pow(update.numel(), 0.5) * r.d()));
    p.add_(update, -alpha / denom);
  }
}

}  // namespace shardopt::test
