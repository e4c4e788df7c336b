// The non-finite check on raw pointers: one read of a contiguous run of fp32/bf16/fp16 values
// that says whether any is NaN or +-Inf, optionally scaling fp32 values in place in the same pass
// (the unscale of mixed precision and of the gradient average) and summing their squares (the
// clip's global norm). Torch-free; scalar/AVX2/AVX-512 on the CPU (threaded like the fused
// kernels, fused.hpp), check_finite_cuda on the GPU (fused_cuda.hpp).
//
// Note [Exact non-finite check]
// A value x is non-finite exactly when x * 0 is NaN (finite x gives +-0), and a sum of +-0 stays
// +-0 while one NaN makes it NaN: the kernels add up x * 0 in float and test the sum once per
// chunk. 16-bit values are widened exactly (bf16: a shift; fp16: F16C or the software conversion),
// so every NaN and Inf of every dtype is found and no finite value raises the flag (the sum of
// zeros cannot overflow, unlike a sum of the values). Squares are summed in double: a float's
// square is exact there and 2^63 of them cannot overflow it.
#pragma once

#include <cstdint>

#include "kernels/fused.hpp"

namespace shardopt::detail::kernels {

enum class ValueKind { Float32, BFloat16, Float16 };

// `numel` values of `kind` at `data` (any alignment); written only when scaling.
struct CheckSegment {
  ValueKind kind = ValueKind::Float32;
  void* data = nullptr;
  int64_t numel = 0;
};

struct CheckOptions {
  // When != 1 (fp32 only): data[i] = data[i] * scale, the float product torch's mul_ computes
  // for a float tensor and a Scalar, before the check and the squares see it.
  float scale = 1.0f;
  bool sum_squares = false;
};

struct CheckResult {
  bool non_finite = false;  // some value (after scaling) is NaN or +-Inf
  double sum_sq = 0.0;      // sum of squares in double, when asked (NaN/Inf when non_finite)
};

// Multi-threaded over chunks of kChunkNumel (fused.hpp) like the update kernels; the partial sums
// of squares are added in chunk order, so they do not depend on the thread count (they may differ
// in the last bits across ISAs). Throws InvalidArgument for null data with numel > 0, a negative
// numel, or a scale != 1 on 16-bit values.
CheckResult check_finite(const CheckSegment& segment, const CheckOptions& options = {},
                         CpuIsa isa = CpuIsa::Auto);

namespace raw {
// One pass on the calling thread (tests and callers that bring their own threads).
CheckResult check_finite(CpuIsa isa, const CheckSegment& segment, const CheckOptions& options);
}  // namespace raw

}  // namespace shardopt::detail::kernels
