// RuleStep: the torch-side elementwise update of each native rule on one contiguous segment. These
// mirror torch::optim's own formulas op for op, so a segment updates exactly as torch updates the
// tensors it covers. Used by LocalUpdate where no fused kernel steps the segment.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <vector>

#include "shardopt/error.hpp"
#include "shardopt/rules.hpp"

namespace shardopt::detail {

struct RuleStep {
  int64_t step;  // 1-based, after increment

  void operator()(const AdamW& r, at::Tensor& p, at::Tensor& g, std::vector<at::Tensor>& st) const {
    if (r.weight_decay() != 0) p.mul_(1 - r.lr() * r.weight_decay());
    adam(r.lr(), r.beta1(), r.beta2(), r.eps(), r.amsgrad(), p, g, st);
  }
  void operator()(const Adam& r, at::Tensor& p, at::Tensor& g, std::vector<at::Tensor>& st) const {
    at::Tensor grad = r.weight_decay() != 0 ? g.add(p, r.weight_decay()) : g;
    adam(r.lr(), r.beta1(), r.beta2(), r.eps(), r.amsgrad(), p, grad, st);
  }
  void operator()(const SGD& r, at::Tensor& p, at::Tensor& g, std::vector<at::Tensor>& st) const {
    at::Tensor d_p = r.weight_decay() != 0 ? g.add(p, r.weight_decay()) : g;
    if (r.momentum() != 0) {
      at::Tensor& buf = st[0];
      if (step == 1) {
        buf.copy_(d_p);  // torch starts the buffer at the first gradient, not at zero
      } else {
        buf.mul_(r.momentum()).add_(d_p, 1 - r.dampening());
      }
      d_p = r.nesterov() ? d_p.add(buf, r.momentum()) : buf;
    }
    p.add_(d_p, -r.lr());
  }
  void operator()(const Adagrad& r, at::Tensor& p, at::Tensor& g, std::vector<at::Tensor>& st) const {
    at::Tensor grad = r.weight_decay() != 0 ? g.add(p, r.weight_decay()) : g;
    const double clr = r.lr() / (1 + static_cast<double>(step - 1) * r.lr_decay());
    st[0].addcmul_(grad, grad, 1.0);
    at::Tensor std = st[0].sqrt().add_(r.eps());
    p.addcdiv_(grad, std, -clr);
  }
  void operator()(const RMSprop& r, at::Tensor& p, at::Tensor& g, std::vector<at::Tensor>& st) const {
    at::Tensor grad = r.weight_decay() != 0 ? g.add(p, r.weight_decay()) : g;
    at::Tensor& square_avg = st[0];
    square_avg.mul_(r.alpha()).addcmul_(grad, grad, 1 - r.alpha());
    size_t next = 1;
    at::Tensor avg;
    if (r.centered()) {
      at::Tensor& grad_avg = st[1 + (r.momentum() > 0 ? 1 : 0)];
      grad_avg.mul_(r.alpha()).add_(grad, 1 - r.alpha());
      avg = square_avg.addcmul(grad_avg, grad_avg, -1).sqrt_().add_(r.eps());
    } else {
      avg = square_avg.sqrt().add_(r.eps());
    }
    if (r.momentum() > 0) {
      at::Tensor& buf = st[next];
      buf.mul_(r.momentum()).addcdiv_(grad, avg);
      p.add_(buf, -r.lr());
    } else {
      p.addcdiv_(grad, avg, -r.lr());
    }
  }
  void operator()(const Lamb&, at::Tensor&, at::Tensor&, std::vector<at::Tensor>&) const {
    SHARDOPT_INTERNAL_ASSERT(false, "LAMB has its own two-phase path");
  }
  void operator()(const Adafactor&, at::Tensor&, at::Tensor&, std::vector<at::Tensor>&) const {
    SHARDOPT_INTERNAL_ASSERT(false, "Adafactor has its own path (adafactor_update.hpp)");
  }
  void operator()(const AdamW8bit&, at::Tensor&, at::Tensor&, std::vector<at::Tensor>&) const {
    SHARDOPT_INTERNAL_ASSERT(false, "8-bit AdamW has its own path (adam8bit_update.hpp)");
  }
  void operator()(const Muon&, at::Tensor&, at::Tensor&, std::vector<at::Tensor>&) const {
    SHARDOPT_INTERNAL_ASSERT(false, "Muon has its own path (muon_update.hpp)");
  }

  void adam(double lr, double beta1, double beta2, double eps, bool amsgrad, at::Tensor& p,
            const at::Tensor& grad, std::vector<at::Tensor>& st) const {
    const double bias_correction1 = 1 - std::pow(beta1, static_cast<double>(step));
    const double bias_correction2 = 1 - std::pow(beta2, static_cast<double>(step));
    st[0].mul_(beta1).add_(grad, 1 - beta1);
    st[1].mul_(beta2).addcmul_(grad, grad, 1 - beta2);
    at::Tensor denom;
    if (amsgrad) {
      at::max_out(st[2], st[1], st[2]);
      denom = (st[2].sqrt() / std::sqrt(bias_correction2)).add_(eps);
    } else {
      denom = (st[1].sqrt() / std::sqrt(bias_correction2)).add_(eps);
    }
    p.addcdiv_(st[0], denom, -lr / bias_correction1);
  }
};

}  // namespace shardopt::detail
