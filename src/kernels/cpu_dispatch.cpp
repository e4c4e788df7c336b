// CPU kernel drivers: hyper-parameters -> float coefficients (once, as torch rounds them), the
// instruction set chosen at run time, argument checks, and at::parallel_for over fixed chunks.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu_kernels.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail::kernels {

AdamCoeffs adam_coeffs(const AdamHyper& h) {
  AdamCoeffs c;
  if (h.weight_decay != 0) {
    c.decay = h.decoupled ? AdamCoeffs::kDecayParam : AdamCoeffs::kDecayGrad;
    c.decay_param = static_cast<float>(1 - h.lr * h.weight_decay);
    c.decay_grad = static_cast<float>(h.weight_decay);
  }
  c.amsgrad = h.amsgrad;
  const double bias_correction1 = 1 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bias_correction2 = 1 - std::pow(h.beta2, static_cast<double>(h.step));
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1 - h.beta2);
  c.sqrt_bias_correction2 = static_cast<float>(std::sqrt(bias_correction2));
  c.inv_sqrt_bias_correction2 = 1.0 / static_cast<double>(c.sqrt_bias_correction2);
  c.eps = static_cast<float>(h.eps);
  c.neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
  return c;
}

SgdCoeffs sgd_coeffs(const SgdHyper& h) {
  SgdCoeffs c;
  c.decay = h.weight_decay != 0;
  c.weight_decay = static_cast<float>(h.weight_decay);
  c.momentum = h.momentum != 0;
  c.first_step = h.step == 1;
  c.nesterov = h.nesterov;
  c.momentum_factor = static_cast<float>(h.momentum);
  c.one_minus_dampening = static_cast<float>(1 - h.dampening);
  c.neg_lr = static_cast<float>(-h.lr);
  return c;
}

LambCoeffs lamb_coeffs(const LambHyper& h, double trust_ratio) {
  LambCoeffs c;
  c.decay = h.weight_decay != 0;
  c.weight_decay = static_cast<float>(h.weight_decay);
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1 - h.beta2);
  c.bias_correction1 = static_cast<float>(1 - std::pow(h.beta1, static_cast<double>(h.step)));
  c.bias_correction2 = static_cast<float>(1 - std::pow(h.beta2, static_cast<double>(h.step)));
  c.eps = static_cast<float>(h.eps);
  c.neg_lr_trust = static_cast<float>(-h.lr * trust_ratio);
  return c;
}

// ---- instruction sets -------------------------------------------------------------------------

const char* to_string(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Auto:
      return "auto";
    case CpuIsa::Scalar:
      return "scalar";
    case CpuIsa::Avx2:
      return "avx2";
    case CpuIsa::Avx512:
      return "avx512";
  }
  return "?";
}

bool cpu_isa_supported(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Auto:
    case CpuIsa::Scalar:
      return true;
#if defined(SHARDOPT_KERNELS_X86)
    case CpuIsa::Avx2:  // the builtins also check that the OS saves the YMM/ZMM state
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case CpuIsa::Avx512:
      return cpu_isa_supported(CpuIsa::Avx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#else
    case CpuIsa::Avx2:
    case CpuIsa::Avx512:
      return false;
#endif
  }
  return false;
}

namespace {

// What Auto means: SHARDOPT_CPU_KERNEL when set, else the widest supported set. Read once.
CpuIsa auto_isa() {
  static const CpuIsa chosen = [] {
    if (const char* env = std::getenv("SHARDOPT_CPU_KERNEL"); env != nullptr && *env != '\0') {
      for (CpuIsa isa : {CpuIsa::Scalar, CpuIsa::Avx2, CpuIsa::Avx512}) {
        if (std::strcmp(env, to_string(isa)) == 0) {
          SHARDOPT_CHECK(cpu_isa_supported(isa), Unsupported,
                         "kernels: SHARDOPT_CPU_KERNEL={} but this CPU or build does not "
                         "support it; supported: scalar{}{}",
                         env, cpu_isa_supported(CpuIsa::Avx2) ? ", avx2" : "",
                         cpu_isa_supported(CpuIsa::Avx512) ? ", avx512" : "");
          return isa;
        }
      }
      SHARDOPT_FAIL(InvalidArgument,
                    "kernels: SHARDOPT_CPU_KERNEL must be scalar, avx2 or avx512, got '{}'", env);
    }
    if (cpu_isa_supported(CpuIsa::Avx512)) return CpuIsa::Avx512;
    if (cpu_isa_supported(CpuIsa::Avx2)) return CpuIsa::Avx2;
    return CpuIsa::Scalar;
  }();
  return chosen;
}

const CpuKernelTable& table(CpuIsa isa) {
  switch (isa) {
#if defined(SHARDOPT_KERNELS_X86)
    case CpuIsa::Avx2:
      return kAvx2Kernels;
    case CpuIsa::Avx512:
      return kAvx512Kernels;
#endif
    default:
      return kScalarKernels;
  }
}

}  // namespace

CpuIsa resolve_cpu_isa(CpuIsa isa) {
  if (isa == CpuIsa::Auto) return auto_isa();
  SHARDOPT_CHECK(cpu_isa_supported(isa), Unsupported,
                 "kernels: the {} kernels need a CPU (and build) that supports them; this one "
                 "does not",
                 to_string(isa));
  return isa;
}

// ---- single-threaded entry points -------------------------------------------------------------

namespace raw {
void adam(CpuIsa isa, const AdamHyper& hyper, const AdamSegment& segment) {
  table(resolve_cpu_isa(isa)).adam(adam_coeffs(hyper), segment);
}
void sgd(CpuIsa isa, const SgdHyper& hyper, const SgdSegment& segment) {
  table(resolve_cpu_isa(isa)).sgd(sgd_coeffs(hyper), segment);
}
LambNorms lamb_phase1(CpuIsa isa, const LambHyper& hyper, const LambSegment& segment) {
  return table(resolve_cpu_isa(isa)).lamb_phase1(lamb_coeffs(hyper, 1.0), segment);
}
void lamb_phase2(CpuIsa isa, const LambHyper& hyper, double trust_ratio,
                 const LambSegment& segment) {
  table(resolve_cpu_isa(isa)).lamb_phase2(lamb_coeffs(hyper, trust_ratio), segment);
}
CheckResult check_finite(CpuIsa isa, const CheckSegment& segment, const CheckOptions& options) {
  return table(resolve_cpu_isa(isa)).check_finite(segment, options);
}
}  // namespace raw

// ---- multi-threaded drivers -------------------------------------------------------------------

namespace {

// Chunks of kChunkNumel elements from the segment start; a thread takes a contiguous run of
// them. Small segments (under two chunks) run on the calling thread.
constexpr int64_t kGrainChunks = 2;

template <class Fn>
void for_each_chunk(int64_t numel, const Fn& fn) {
  const int64_t chunks = (numel + kChunkNumel - 1) / kChunkNumel;
  at::parallel_for(0, chunks, kGrainChunks, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      fn(c, c * kChunkNumel, std::min(numel, (c + 1) * kChunkNumel));
    }
  });
}

template <class T>
T* offset(T* p, int64_t begin) {
  return p == nullptr ? nullptr : p + begin;
}
LowPrecisionOut offset(const LowPrecisionOut& low, int64_t begin) {
  return {low.kind, offset(low.data, begin)};
}

void check_buffer(const void* p, const char* what, const char* kernel, int64_t numel) {
  SHARDOPT_CHECK(p != nullptr || numel == 0, InvalidArgument,
                 "kernels: {}: segment.{} is null, expected {} elements", kernel, what, numel);
}
void check_common(const char* kernel, int64_t numel, int64_t step, const LowPrecisionOut& low) {
  SHARDOPT_CHECK(numel >= 0, InvalidArgument, "kernels: {}: segment.numel must be >= 0, got {}",
                 kernel, numel);
  SHARDOPT_CHECK(step >= 1, InvalidArgument,
                 "kernels: {}: hyper.step is 1-based (incremented before the update), got {}",
                 kernel, step);
  if (low.kind != LowPrecision::None) check_buffer(low.data, "low.data", kernel, numel);
}

}  // namespace

void fused_adam(const AdamHyper& hyper, const AdamSegment& s, CpuIsa isa) {
  check_common("fused_adam", s.numel, hyper.step, s.low);
  check_buffer(s.param, "param", "fused_adam", s.numel);
  check_buffer(s.grad, "grad", "fused_adam", s.numel);
  check_buffer(s.exp_avg, "exp_avg", "fused_adam", s.numel);
  check_buffer(s.exp_avg_sq, "exp_avg_sq", "fused_adam", s.numel);
  if (hyper.amsgrad)
    check_buffer(s.max_exp_avg_sq, "max_exp_avg_sq (amsgrad)", "fused_adam", s.numel);
  const auto kernel = table(resolve_cpu_isa(isa)).adam;
  const AdamCoeffs c = adam_coeffs(hyper);
  for_each_chunk(s.numel, [&](int64_t, int64_t b, int64_t e) {
    kernel(c, {s.param + b, s.grad + b, s.exp_avg + b, s.exp_avg_sq + b,
               hyper.amsgrad ? s.max_exp_avg_sq + b : nullptr, offset(s.low, b), e - b});
  });
}

void fused_sgd(const SgdHyper& hyper, const SgdSegment& s, CpuIsa isa) {
  check_common("fused_sgd", s.numel, hyper.step, s.low);
  check_buffer(s.param, "param", "fused_sgd", s.numel);
  check_buffer(s.grad, "grad", "fused_sgd", s.numel);
  const bool momentum = hyper.momentum != 0;
  if (momentum) check_buffer(s.momentum_buffer, "momentum_buffer", "fused_sgd", s.numel);
  const auto kernel = table(resolve_cpu_isa(isa)).sgd;
  const SgdCoeffs c = sgd_coeffs(hyper);
  for_each_chunk(s.numel, [&](int64_t, int64_t b, int64_t e) {
    kernel(c, {s.param + b, s.grad + b, momentum ? s.momentum_buffer + b : nullptr,
               offset(s.low, b), e - b});
  });
}

LambNorms fused_lamb_phase1(const LambHyper& hyper, const LambSegment& s, CpuIsa isa) {
  check_common("fused_lamb_phase1", s.numel, hyper.step, {});
  for (auto [p, what] : {std::pair<const void*, const char*>{s.param, "param"},
                         {s.grad, "grad"},
                         {s.exp_avg, "exp_avg"},
                         {s.exp_avg_sq, "exp_avg_sq"}}) {
    check_buffer(p, what, "fused_lamb_phase1", s.numel);
  }
  const auto kernel = table(resolve_cpu_isa(isa)).lamb_phase1;
  const LambCoeffs c = lamb_coeffs(hyper, 1.0);
  // Per-chunk partial sums, added in chunk order: the result does not depend on the threads.
  std::vector<LambNorms> partial(static_cast<size_t>((s.numel + kChunkNumel - 1) / kChunkNumel));
  for_each_chunk(s.numel, [&](int64_t chunk, int64_t b, int64_t e) {
    partial[chunk] =
        kernel(c, {s.param + b, s.grad + b, s.exp_avg + b, s.exp_avg_sq + b, {}, e - b});
  });
  LambNorms total;
  for (const auto& p : partial) {
    total.param_sq += p.param_sq;
    total.update_sq += p.update_sq;
  }
  return total;
}

void fused_lamb_phase2(const LambHyper& hyper, double trust_ratio, const LambSegment& s,
                       CpuIsa isa) {
  check_common("fused_lamb_phase2", s.numel, hyper.step, s.low);
  for (auto [p, what] : {std::pair<const void*, const char*>{s.param, "param"},
                         {s.exp_avg, "exp_avg"},
                         {s.exp_avg_sq, "exp_avg_sq"}}) {
    check_buffer(p, what, "fused_lamb_phase2", s.numel);
  }
  const auto kernel = table(resolve_cpu_isa(isa)).lamb_phase2;
  const LambCoeffs c = lamb_coeffs(hyper, trust_ratio);
  for_each_chunk(s.numel, [&](int64_t, int64_t b, int64_t e) {
    kernel(c, {s.param + b, nullptr, s.exp_avg + b, s.exp_avg_sq + b, offset(s.low, b), e - b});
  });
}

CheckResult check_finite(const CheckSegment& s, const CheckOptions& o, CpuIsa isa) {
  SHARDOPT_CHECK(s.numel >= 0, InvalidArgument,
                 "kernels: check_finite: segment.numel must be >= 0, got {}", s.numel);
  check_buffer(s.data, "data", "check_finite", s.numel);
  SHARDOPT_CHECK(o.scale == 1.0f || s.kind == ValueKind::Float32, InvalidArgument,
                 "kernels: check_finite: scaling (scale {}) needs fp32 values; scale 16-bit "
                 "values with torch's mul_ first",
                 o.scale);
  const auto kernel = table(resolve_cpu_isa(isa)).check_finite;
  const int64_t elem = s.kind == ValueKind::Float32 ? 4 : 2;
  // Per-chunk results, combined in chunk order: the sum does not depend on the threads.
  std::vector<CheckResult> partial(static_cast<size_t>((s.numel + kChunkNumel - 1) / kChunkNumel));
  for_each_chunk(s.numel, [&](int64_t chunk, int64_t b, int64_t e) {
    partial[chunk] = kernel({s.kind, static_cast<char*>(s.data) + b * elem, e - b}, o);
  });
  CheckResult total;
  for (const auto& p : partial) {
    total.non_finite = total.non_finite || p.non_finite;
    total.sum_sq += p.sum_sq;
  }
  return total;
}

}  // namespace shardopt::detail::kernels
