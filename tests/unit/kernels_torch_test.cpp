// The fused CPU kernels against torch::optim::AdamW/Adam/SGD and the engine's LAMB over several
// steps (<= 1e-6), for every instruction set this CPU has.
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "unit/kernels_support.hpp"

namespace shardopt::detail::kernels {
namespace {

class KernelTorch : public KernelIsa {};

struct TorchCase {
  at::Tensor param;                  // the torch optimizer's parameter
  std::vector<float> p, m, v, vmax;  // the kernel's copies
};

double max_abs_diff(const at::Tensor& t, const std::vector<float>& values) {
  const at::Tensor other = at::from_blob(const_cast<float*>(values.data()), {t.numel()});
  return (t.detach().reshape({-1}) - other).abs().max().item<double>();
}
int64_t bit_differences(const at::Tensor& t, const std::vector<float>& values) {
  const float* a = t.data_ptr<float>();
  int64_t count = 0;
  for (int64_t i = 0; i < t.numel(); ++i) count += bits(a[i]) != bits(values[i]);
  return count;
}


constexpr int64_t kTorchNumel = 1003;  // one partial vector at the end for every ISA
constexpr int kTorchSteps = 10;

// Runs `steps` steps of a torch optimizer `opt` on `param` and of `kernel_step(step, grad)`.
template <class Opt, class KernelStep>
void run_against_torch(Opt& opt, at::Tensor& param, KernelStep&& kernel_step) {
  for (int step = 1; step <= kTorchSteps; ++step) {
    const auto grad = normal(kTorchNumel, 0.3f, 100 + step);
    param.mutable_grad() = at::from_blob(const_cast<float*>(grad.data()), {kTorchNumel}).clone();
    opt.step();
    kernel_step(step, grad);
  }
}

TEST_P(KernelTorch, AdamWAndAdamMatchTorchOptim) {
  struct Config {
    bool decoupled;
    double wd;
    bool amsgrad;
  };
  for (const Config cfg :
       {Config{true, 0.01, false}, Config{true, 0.0, false}, Config{true, 0.1, true},
        Config{false, 0.0, false}, Config{false, 0.05, false}, Config{false, 0.05, true}}) {
    const auto init = normal(kTorchNumel, 1.0f, 42);
    at::Tensor param = at::from_blob(const_cast<float*>(init.data()), {kTorchNumel}).clone();
    param.set_requires_grad(true);
    std::vector<float> p = init, m(kTorchNumel), v(kTorchNumel), vmax(kTorchNumel);
    std::vector<uint16_t> low(kTorchNumel);
    const double lr = 2e-3, b1 = 0.85, b2 = 0.995, eps = 1e-7;
    auto kernel_step = [&](int step, const std::vector<float>& grad) {
      AdamHyper h;
      h.lr = lr, h.beta1 = b1, h.beta2 = b2, h.eps = eps, h.weight_decay = cfg.wd;
      h.decoupled = cfg.decoupled, h.amsgrad = cfg.amsgrad, h.step = step;
      fused_adam(h,
                 {p.data(),
                  grad.data(),
                  m.data(),
                  v.data(),
                  vmax.data(),
                  {LowPrecision::Float16, low.data()},
                  kTorchNumel},
                 isa());
    };
    if (cfg.decoupled) {
      torch::optim::AdamW opt(
          {param},
          torch::optim::AdamWOptions(lr).betas({b1, b2}).eps(eps).weight_decay(cfg.wd).amsgrad(
              cfg.amsgrad));
      run_against_torch(opt, param, kernel_step);
    } else {
      torch::optim::Adam opt(
          {param},
          torch::optim::AdamOptions(lr).betas({b1, b2}).eps(eps).weight_decay(cfg.wd).amsgrad(
              cfg.amsgrad));
      run_against_torch(opt, param, kernel_step);
    }
    const std::string name = std::string(cfg.decoupled ? "adamw" : "adam") + "_wd" +
                             std::to_string(cfg.wd) + (cfg.amsgrad ? "_amsgrad" : "");
    SCOPED_TRACE(name);
    EXPECT_LE(max_abs_diff(param, p), 1e-6);
    // Informational: 0 where torch runs its AVX2/AVX-512 kernels (the same FMAs as ours).
    RecordProperty("bit_differences_" + name,
                   static_cast<int>(bit_differences(param.detach(), p)));
    // The fp16 copy is the cast of the fp32 result.
    const at::Tensor want = at::from_blob(p.data(), {kTorchNumel}).to(at::kHalf);
    EXPECT_SAME_BITS(low.data(), static_cast<const uint16_t*>(want.data_ptr()), kTorchNumel,
                     "fp16 copy");
  }
}

TEST_P(KernelTorch, SgdMatchesTorchOptim) {
  struct Config {
    double momentum, dampening, wd;
    bool nesterov;
  };
  for (const Config cfg :
       {Config{0, 0, 0, false}, Config{0, 0, 1e-2, false}, Config{0.9, 0, 0, false},
        Config{0.9, 0.1, 1e-3, false}, Config{0.9, 0, 1e-3, true}}) {
    const auto init = normal(kTorchNumel, 1.0f, 43);
    at::Tensor param = at::from_blob(const_cast<float*>(init.data()), {kTorchNumel}).clone();
    param.set_requires_grad(true);
    std::vector<float> p = init, buf(kTorchNumel);
    std::vector<uint16_t> low(kTorchNumel);
    const double lr = 0.05;
    torch::optim::SGD opt({param}, torch::optim::SGDOptions(lr)
                                       .momentum(cfg.momentum)
                                       .dampening(cfg.dampening)
                                       .weight_decay(cfg.wd)
                                       .nesterov(cfg.nesterov));
    run_against_torch(opt, param, [&](int step, const std::vector<float>& grad) {
      SgdHyper h;
      h.lr = lr, h.momentum = cfg.momentum, h.dampening = cfg.dampening;
      h.weight_decay = cfg.wd, h.nesterov = cfg.nesterov, h.step = step;
      fused_sgd(
          h, {p.data(), grad.data(), buf.data(), {LowPrecision::BFloat16, low.data()}, kTorchNumel},
          isa());
    });
    SCOPED_TRACE("momentum " + std::to_string(cfg.momentum) + " nesterov " +
                 std::to_string(cfg.nesterov));
    EXPECT_LE(max_abs_diff(param, p), 1e-6);
    const at::Tensor want = at::from_blob(p.data(), {kTorchNumel}).to(at::kBFloat16);
    EXPECT_SAME_BITS(low.data(), static_cast<const uint16_t*>(want.data_ptr()), kTorchNumel,
                     "bf16 copy");
  }
}

// LAMB has no torch::optim class: the reference is the engine's own op sequence
// (src/engine/local_update.cpp, lamb_update) on one whole parameter.
TEST_P(KernelTorch, LambMatchesEngineOpSequence) {
  for (double wd : {0.0, 0.01}) {
    const auto init = normal(kTorchNumel, 1.0f, 44);
    at::Tensor tp = at::from_blob(const_cast<float*>(init.data()), {kTorchNumel}).clone();
    at::Tensor tm = at::zeros_like(tp), tv = at::zeros_like(tp);
    std::vector<float> p = init, m(kTorchNumel), v(kTorchNumel);
    LambHyper h;
    h.lr = 1e-2, h.weight_decay = wd;
    for (int step = 1; step <= kTorchSteps; ++step) {
      const auto grad = normal(kTorchNumel, 0.3f, 200 + step);
      const at::Tensor g = at::from_blob(const_cast<float*>(grad.data()), {kTorchNumel});
      tm.mul_(h.beta1).add_(g, 1 - h.beta1);
      tv.mul_(h.beta2).addcmul_(g, g, 1 - h.beta2);
      const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(step));
      const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(step));
      at::Tensor u = (tm / bc1) / ((tv / bc2).sqrt() + h.eps);
      if (wd != 0) u.add_(tp, wd);
      const double wn = tp.norm().item<double>(), un = u.norm().item<double>();
      tp.add_(u, -h.lr * ((wn > 0 && un > 0) ? wn / un : 1.0));

      h.step = step;
      const LambSegment s{p.data(), grad.data(), m.data(), v.data(), {}, kTorchNumel};
      const LambNorms norms = fused_lamb_phase1(h, s, isa());
      EXPECT_NEAR(std::sqrt(norms.param_sq), wn, 1e-5 * wn);
      EXPECT_NEAR(std::sqrt(norms.update_sq), un, 1e-5 * un);
      const double w = std::sqrt(norms.param_sq), uu = std::sqrt(norms.update_sq);
      fused_lamb_phase2(h, (w > 0 && uu > 0) ? w / uu : 1.0, s, isa());
    }
    SCOPED_TRACE("wd " + std::to_string(wd));
    EXPECT_LE(max_abs_diff(tp, p), 1e-6);
    EXPECT_LE(max_abs_diff(tm, m), 1e-6);
    EXPECT_LE(max_abs_diff(tv, v), 1e-6);
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, KernelTorch,
                         ::testing::Values(CpuIsa::Scalar, CpuIsa::Avx2, CpuIsa::Avx512),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace shardopt::detail::kernels
