// The non-finite check (finite.hpp) on the GPU: one grid-stride pass that scales fp32 values in
// place when asked, counts non-finite values and sums squares in double, per block and then over
// blocks in a fixed order (deterministic, not in the CPU's order). The flag is exact at every
// dtype: the exponent bits decide (Note [Exact non-finite check]).
#include <cuda_bf16.h>

#include "kernels/cuda_common.cuh"
#include "kernels/fused_cuda.hpp"

namespace shardopt::detail::kernels {
namespace {

using cuda::kThreads;
constexpr int kCheckBlocks = 1024;  // partial sums: at most this many per segment

template <ValueKind kKind>
__device__ __forceinline__ float value_at(const void* data, int64_t i) {
  if (kKind == ValueKind::Float32) return static_cast<const float*>(data)[i];
  const uint16_t bits = static_cast<const uint16_t*>(data)[i];
  if (kKind == ValueKind::BFloat16) return __uint_as_float(static_cast<uint32_t>(bits) << 16);
  return __half2float(__ushort_as_half(bits));
}

// partial[2*block] = count of non-finite values, partial[2*block+1] = sum of squares.
template <ValueKind kKind, bool kScale>
__global__ void __launch_bounds__(kThreads)
    check_kernel(void* data, int64_t n, float scale, double* __restrict__ partial) {
  double bad = 0, sq = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += stride) {
    float x = value_at<kKind>(data, i);
    if (kScale) {
      x = __fmul_rn(x, scale);
      static_cast<float*>(data)[i] = x;
    }
    if (!isfinite(x)) bad += 1;
    sq = __dadd_rn(sq, __dmul_rn(x, x));  // as the CPU's acc_sq: no fma
  }
  cuda::block_sum2(bad, sq, partial + 2 * blockIdx.x);
}

template <ValueKind kKind, bool kScale>
void launch(const CheckSegment& s, float scale, unsigned grid, double* partial, cudaStream_t st) {
  check_kernel<kKind, kScale><<<grid, kThreads, 0, st>>>(s.data, s.numel, scale, partial);
}

}  // namespace

CheckResult check_finite_cuda(const CheckSegment& s, const CheckOptions& o, void* stream) {
  SHARDOPT_CHECK(s.numel >= 0, InvalidArgument,
                 "kernels: check_finite_cuda: numel must be >= 0, got {}", s.numel);
  CheckResult result;
  if (s.numel == 0) return result;
  SHARDOPT_CHECK(s.data != nullptr, InvalidArgument,
                 "kernels: check_finite_cuda: data is null, expected {} elements", s.numel);
  const bool scale = o.scale != 1.0f;
  SHARDOPT_CHECK(!scale || s.kind == ValueKind::Float32, InvalidArgument,
                 "kernels: check_finite_cuda: scaling (scale {}) needs fp32 values", o.scale);
  const auto st = static_cast<cudaStream_t>(stream);
  const unsigned grid = cuda::grid_for(s.numel, kCheckBlocks);
  double* partial = nullptr;
  cuda::check(cudaMallocAsync(reinterpret_cast<void**>(&partial), 2 * grid * sizeof(double), st),
              "allocating the non-finite check's partial sums");
  if (scale) {
    launch<ValueKind::Float32, true>(s, o.scale, grid, partial, st);
  } else if (s.kind == ValueKind::Float32) {
    launch<ValueKind::Float32, false>(s, 1.0f, grid, partial, st);
  } else if (s.kind == ValueKind::BFloat16) {
    launch<ValueKind::BFloat16, false>(s, 1.0f, grid, partial, st);
  } else {
    launch<ValueKind::Float16, false>(s, 1.0f, grid, partial, st);
  }
  double sums[2];
  cuda::sums2_to_host(partial, grid, st, sums, "the non-finite check");
  result.non_finite = sums[0] > 0;
  result.sum_sq = o.sum_squares ? sums[1] : 0.0;
  return result;
}

}  // namespace shardopt::detail::kernels
