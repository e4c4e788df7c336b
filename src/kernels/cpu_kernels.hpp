// Internal interface between the CPU kernel drivers (cpu_dispatch.cpp) and the per-ISA kernel
// translation units: the float coefficients every variant shares and one table of entry points
// per instruction set.
#pragma once

#include "kernels/finite.hpp"
#include "kernels/fused.hpp"

namespace shardopt::detail::kernels {

// Scalars derived from the hyper-parameters once per call, in double, rounded to float the way
// torch rounds a double Scalar for a float tensor op (Note [Kernel arithmetic]).
struct AdamCoeffs {
  enum Decay { kNoDecay, kDecayParam, kDecayGrad };
  Decay decay = kNoDecay;
  bool amsgrad = false;
  float decay_param = 1;  // AdamW: p *= float(1 - lr*wd)
  float decay_grad = 0;   // Adam: g = fma(p, float(wd), g)
  float beta1 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0;
  float sqrt_bias_correction2 = 1;
  // 1 / double(sqrt_bias_correction2): see Note [Division by a constant].
  double inv_sqrt_bias_correction2 = 1;
  float eps = 0;
  float neg_step_size = 0;  // float(-(lr / bias_correction1))
};

struct SgdCoeffs {
  bool decay = false, momentum = false, first_step = false, nesterov = false;
  float weight_decay = 0;
  float momentum_factor = 0;
  float one_minus_dampening = 1;
  float neg_lr = 0;
};

struct LambCoeffs {
  bool decay = false;
  float beta1 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0;
  float bias_correction1 = 1, bias_correction2 = 1;
  float eps = 0;
  float weight_decay = 0;
  float neg_lr_trust = 0;  // phase 2: float(-lr * trust_ratio)
};

AdamCoeffs adam_coeffs(const AdamHyper& h);
SgdCoeffs sgd_coeffs(const SgdHyper& h);
LambCoeffs lamb_coeffs(const LambHyper& h, double trust_ratio);

// Note [Division by a constant]
// x / c for a float constant c is RN(x / c). The vector kernels compute it as
// float(double(x) * RN_double(1 / c)) instead, which keeps the divider (shared with sqrt, and the
// bottleneck of a step: ~2 cycles per element with three divider operations) for the other two
// operations. It is bitwise the same: the double product is within 2^-52 relative of x / c, while
// a quotient of two floats that is not a float midpoint lies at least 2^-49 relative from one
// (x - c*m is a nonzero multiple of the product of the units in the last place), and it is never
// a midpoint (c*m would need 25 significant bits). That holds without underflow, i.e. here, where
// x = sqrt(v) >= 2^-75 or 0 and c <= 1; checked exhaustively over every float x for 52 values of
// c. The scalar kernels divide, so the tests compare the two.

// Single-threaded kernels of one instruction set over one segment.
struct CpuKernelTable {
  void (*adam)(const AdamCoeffs&, const AdamSegment&);
  void (*sgd)(const SgdCoeffs&, const SgdSegment&);
  LambNorms (*lamb_phase1)(const LambCoeffs&, const LambSegment&);
  void (*lamb_phase2)(const LambCoeffs&, const LambSegment&);
  CheckResult (*check_finite)(const CheckSegment&, const CheckOptions&);
};

extern const CpuKernelTable kScalarKernels;  // cpu_scalar.cpp: any CPU
#if defined(SHARDOPT_KERNELS_X86)
extern const CpuKernelTable kAvx2Kernels;    // cpu_avx2.cpp: -mavx2 -mfma -mf16c
extern const CpuKernelTable kAvx512Kernels;  // cpu_avx512.cpp: -mavx512f -mavx512bw -mavx512vl
#endif

}  // namespace shardopt::detail::kernels
