// Fused optimizer kernels on CUDA device pointers (adam_cuda.cu, sgd_lamb_cuda.cu; library
// shardopt_cuda_kernels). Same contracts and the same arithmetic as the CPU kernels in fused.hpp
// (Note [Kernel arithmetic]): every elementwise result equals the CPU scalar kernel's bit for bit.
// All calls enqueue on `stream` (a cudaStream_t; nullptr is the legacy default stream) and
// return once enqueued, except fused_lamb_phase1_cuda, which returns the norms and so waits for
// `stream`. They throw InvalidArgument for a malformed segment (before any launch) and
// Unsupported/Internal when a launch fails.
#pragma once

#include <cstdint>

#include "kernels/finite.hpp"
#include "kernels/fused.hpp"

namespace shardopt::detail::kernels {

// Segments per launch; a longer list is split over several launches in stream order.
constexpr int kCudaMaxSegments = 24;

// Updates every segment (AdamSegment with device pointers; numel 0 is skipped) with one kernel
// launch per kCudaMaxSegments segments.
void fused_adam_cuda(const AdamHyper& hyper, const AdamSegment* segments, int64_t count,
                     void* stream = nullptr);

// torch::optim::SGD over one segment (momentum, dampening, nesterov, weight decay).
void fused_sgd_cuda(const SgdHyper& hyper, const SgdSegment& segment, void* stream = nullptr);

// LAMB phase 1 over one segment: moments in place, squared norms of the weights and of the raw
// update summed in double (per block, then over blocks in a fixed order: deterministic, equal to
// the CPU's sums up to the last bits). Synchronises `stream` to return them.
LambNorms fused_lamb_phase1_cuda(const LambHyper& hyper, const LambSegment& segment,
                                 void* stream = nullptr);
// LAMB phase 2 over one segment: p += -lr * trust_ratio * u, writing the low copy if asked.
void fused_lamb_phase2_cuda(const LambHyper& hyper, double trust_ratio, const LambSegment& segment,
                            void* stream = nullptr);

// The non-finite check (finite.hpp) over one segment of device memory: scaling in place when
// asked, the flag, and the squares summed in double per block, then over blocks in a fixed order
// (deterministic; equal to the CPU's sum up to the last bits). Synchronises `stream` to return.
CheckResult check_finite_cuda(const CheckSegment& segment, const CheckOptions& options = {},
                              void* stream = nullptr);

// Visible CUDA devices; 0 where there is no driver or no device (never throws).
int cuda_device_count();

}  // namespace shardopt::detail::kernels
