// Fused multi-tensor Adam/AdamW on CUDA device pointers (adam_cuda.cu, library
// shardopt_cuda_kernels). Same contract and the same arithmetic as the CPU kernels in fused.hpp
// (Note [Kernel arithmetic]): a GPU result equals the CPU scalar kernel's bit for bit.
#pragma once

#include <cstdint>

#include "kernels/fused.hpp"

namespace shardopt::detail::kernels {

// Segments per launch; a longer list is split over several launches in stream order.
constexpr int kCudaMaxSegments = 24;

// Updates every segment (AdamSegment with device pointers; numel 0 is skipped) with one kernel
// launch per kCudaMaxSegments segments, enqueued on `stream` (a cudaStream_t; nullptr is the
// default stream). Asynchronous: returns once enqueued. Throws InvalidArgument for a malformed
// segment (before any launch) and Unsupported/Internal when the launch fails.
void fused_adam_cuda(const AdamHyper& hyper, const AdamSegment* segments, int64_t count,
                     void* stream = nullptr);

// Visible CUDA devices; 0 where there is no driver or no device (never throws).
int cuda_device_count();

}  // namespace shardopt::detail::kernels
