// Fused optimizer kernels on raw pointers: one pass over a contiguous fp32 segment per step
// (Adam/AdamW, SGD with momentum, LAMB's two phases), optionally writing the bf16/fp16 copy of
// the updated parameters in the same pass. Torch-free; the engine calls these per segment.
//
// Note [Kernel arithmetic]
// Every variant (scalar, AVX2, AVX-512, CUDA) performs the same IEEE float operations in the
// same order, with an FMA exactly where torch 1.13's vectorised CPU kernels have one (add with
// alpha, addcmul), so the variants agree bit for bit with each other and with torch's own
// per-op sequence on AVX2/AVX-512 machines. Hyper-parameters are doubles, as in torch's options;
// derived scalars (1 - lr*wd, lr/bias_correction1, ...) are computed in double and rounded to
// float once, as torch does when it passes a double Scalar to a float tensor op.
#pragma once

#include <cstdint>

namespace shardopt::detail::kernels {

// Optional low-precision copy of the updated parameter, written in the same pass. `data` holds
// `numel` 16-bit values at the same indices as the fp32 parameter; rounding is to nearest even
// (as torch's float -> bfloat16/half casts), NaN becomes 0x7FC0 (bf16) or sign|0x7E00 (fp16).
enum class LowPrecision { None, BFloat16, Float16 };
struct LowPrecisionOut {
  LowPrecision kind = LowPrecision::None;
  uint16_t* data = nullptr;
};

// torch::optim::Adam (decoupled = false: weight decay added to the gradient) or AdamW
// (decoupled = true: p *= 1 - lr*wd first), as of torch 1.13 and the engine's RuleStep.
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = true;
  bool amsgrad = false;
  int64_t step = 1;  // 1-based, already incremented (bias corrections use it)
};

// One contiguous segment: every pointer addresses `numel` elements at the same indices; the
// buffers must not overlap each other. Any alignment is accepted (64 bytes is fastest).
struct AdamSegment {
  float* param = nullptr;  // updated in place
  const float* grad = nullptr;
  float* exp_avg = nullptr;         // first moment, updated in place
  float* exp_avg_sq = nullptr;      // second moment, updated in place
  float* max_exp_avg_sq = nullptr;  // running max of exp_avg_sq: required iff hyper.amsgrad
  LowPrecisionOut low;
  int64_t numel = 0;
};

// torch::optim::SGD. Step 1 starts the momentum buffer at the (decayed) gradient, as torch does.
struct SgdHyper {
  double lr = 0.0;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  int64_t step = 1;  // 1-based, already incremented
};

struct SgdSegment {
  float* param = nullptr;
  const float* grad = nullptr;
  float* momentum_buffer = nullptr;  // required iff hyper.momentum != 0
  LowPrecisionOut low;
  int64_t numel = 0;
};

// LAMB as the engine runs it (rules.hpp): phase 1 updates the moments and returns the squared
// norms of the weights and of the raw update u = (m/bc1) / (sqrt(v/bc2) + eps) + wd*p; after the
// partial norms are all-reduced, phase 2 applies p += -lr * trust * u. Phase 2 recomputes u from
// the updated moments (bitwise the same u), so no update buffer is stored: 40 B/param in all.
struct LambHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-6;
  double weight_decay = 0.0;
  int64_t step = 1;  // 1-based, already incremented
};

struct LambSegment {
  float* param = nullptr;       // read in phase 1, updated in phase 2
  const float* grad = nullptr;  // phase 1 only
  float* exp_avg = nullptr;     // updated in phase 1, read in phase 2
  float* exp_avg_sq = nullptr;  // updated in phase 1, read in phase 2
  LowPrecisionOut low;          // phase 2 only
  int64_t numel = 0;
};

// Squared L2 norms over a segment, accumulated in double.
struct LambNorms {
  double param_sq = 0.0;
  double update_sq = 0.0;
};

// Instruction sets of the CPU kernels. Auto picks the best one this CPU supports, unless the
// environment variable SHARDOPT_CPU_KERNEL (scalar|avx2|avx512) names another one.
enum class CpuIsa { Auto, Scalar, Avx2, Avx512 };
const char* to_string(CpuIsa isa);
bool cpu_isa_supported(CpuIsa isa);  // Scalar and Auto always; Avx2 needs AVX2+FMA+F16C
CpuIsa resolve_cpu_isa(CpuIsa isa);  // what Auto means here; throws Unsupported for others

// Multi-threaded (at::parallel_for over chunks of kChunkNumel elements, 64-byte aligned when the
// segment's start is), on the given or the best instruction set. Elementwise results do not
// depend on the thread count or the ISA; LAMB's norms are summed per chunk in a fixed order, so
// they do not depend on the thread count either (they may differ in the last bits across ISAs).
// Throw InvalidArgument on null pointers with numel > 0, negative numel or a missing buffer.
constexpr int64_t kChunkNumel = 16384;
void fused_adam(const AdamHyper& hyper, const AdamSegment& segment, CpuIsa isa = CpuIsa::Auto);
void fused_sgd(const SgdHyper& hyper, const SgdSegment& segment, CpuIsa isa = CpuIsa::Auto);
LambNorms fused_lamb_phase1(const LambHyper& hyper, const LambSegment& segment,
                            CpuIsa isa = CpuIsa::Auto);
// trust_ratio: ||w|| / ||u|| over the whole parameter (1 when either is 0), as the engine computes.
void fused_lamb_phase2(const LambHyper& hyper, double trust_ratio, const LambSegment& segment,
                       CpuIsa isa = CpuIsa::Auto);

// The single-threaded kernels behind the drivers, for tests and callers that bring their own
// threads: one pass over the whole segment. Throw Unsupported for an ISA this CPU lacks; no other
// argument checks.
namespace raw {
void adam(CpuIsa isa, const AdamHyper& hyper, const AdamSegment& segment);
void sgd(CpuIsa isa, const SgdHyper& hyper, const SgdSegment& segment);
LambNorms lamb_phase1(CpuIsa isa, const LambHyper& hyper, const LambSegment& segment);
void lamb_phase2(CpuIsa isa, const LambHyper& hyper, double trust_ratio,
                 const LambSegment& segment);
}  // namespace raw

}  // namespace shardopt::detail::kernels
