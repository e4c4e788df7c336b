// Device helpers shared by the CUDA kernel translation units (adam_cuda.cu, sgd_lamb_cuda.cu):
// the 16-bit conversions the CPU kernels perform in software, and the launch-error translation.
// Every arithmetic operation in the kernels is an explicit round-to-nearest intrinsic
// (Note [Kernel arithmetic] in fused.hpp), so nvcc contracts nothing the CPU kernels do not.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "kernels/fused.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail::kernels::cuda {

constexpr int kThreads = 256;

__device__ __forceinline__ uint16_t bf16_bits(float x) {
  if (isnan(x)) return 0x7FC0;
  const uint32_t u = __float_as_uint(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ uint16_t fp16_bits(float x) {
  if (isnan(x)) return static_cast<uint16_t>(((__float_as_uint(x) >> 16) & 0x8000u) | 0x7E00u);
  return __half_as_ushort(__float2half_rn(x));
}

__device__ __forceinline__ void store_low(LowPrecision kind, uint16_t* low, int64_t i, float p) {
  if (kind == LowPrecision::BFloat16) low[i] = bf16_bits(p);
  if (kind == LowPrecision::Float16) low[i] = fp16_bits(p);
}

// The block's two sums of (a, b), in a fixed tree order, into out[0..1] (thread 0 writes).
__device__ __forceinline__ void block_sum2(double a, double b, double* out) {
  __shared__ double sa[kThreads];
  __shared__ double sb[kThreads];
  sa[threadIdx.x] = a;
  sb[threadIdx.x] = b;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      sa[threadIdx.x] += sa[threadIdx.x + half];
      sb[threadIdx.x] += sb[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    out[0] = sa[0];
    out[1] = sb[0];
  }
}

namespace {  // NOLINT(build/namespaces): a kernel of its own in each translation unit

// One block: the pairs partial[2b], partial[2b+1] of `blocks` blocks summed in a fixed tree order
// into partial[0..1].
__global__ void __launch_bounds__(kThreads) sum2_kernel(double* partial, int blocks) {
  double a = 0, b = 0;
  for (int k = threadIdx.x; k < blocks; k += kThreads) {
    a += partial[2 * k];
    b += partial[2 * k + 1];
  }
  block_sum2(a, b, partial);  // its barrier orders every read above before the write
}

}  // namespace

// Throws Unsupported where there is no usable device or driver, Internal otherwise.
inline void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  const bool unsupported = err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver ||
                           err == cudaErrorNoKernelImageForDevice;
  const std::string msg = fmt::format("kernels: {} failed: {} ({})", what, cudaGetErrorString(err),
                                      cudaGetErrorName(err));
  if (unsupported) SHARDOPT_FAIL(Unsupported, "{}", msg);
  SHARDOPT_FAIL(Internal, "{}", msg);
}

// Blocks for a grid-stride loop over n elements (at least one, at most `cap`).
inline unsigned grid_for(int64_t n, int64_t cap = 65535) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

namespace {  // NOLINT(build/namespaces)
// After a kernel that left per-block pairs in `partial` (from cudaMallocAsync on `st`): sums them,
// copies the two totals into out[0..1], frees `partial` and waits for `st`. `what` names the
// operation in errors.
inline void sums2_to_host(double* partial, unsigned blocks, cudaStream_t st, double out[2],
                          const char* what) {
  sum2_kernel<<<1, kThreads, 0, st>>>(partial, static_cast<int>(blocks));
  const cudaError_t launched = cudaGetLastError();
  out[0] = out[1] = 0;
  const cudaError_t copied =
      launched == cudaSuccess
          ? cudaMemcpyAsync(out, partial, 2 * sizeof(double), cudaMemcpyDeviceToHost, st)
          : launched;
  cudaFreeAsync(partial, st);
  check(copied, fmt::format("launching {}", what).c_str());
  check(cudaStreamSynchronize(st), fmt::format("{} (sums to the host)", what).c_str());
}
}  // namespace

}  // namespace shardopt::detail::kernels::cuda
