// Fused SGD and LAMB's two phases on the GPU, one contiguous segment per call, with the CPU
// kernels' operations in the CPU kernels' order (cpu_kernels_impl.hpp), so the elementwise
// results equal the CPU scalar kernel's bit for bit. LAMB's phase-1 norms are summed in double
// per block and then over blocks in a fixed order: deterministic, but not in the CPU's order.
#include "kernels/cpu_kernels.hpp"
#include "kernels/cuda_common.cuh"
#include "kernels/fused_cuda.hpp"

namespace shardopt::detail::kernels {
namespace {

using cuda::block_sum2;
using cuda::kThreads;
constexpr int kNormBlocks = 1024;  // phase-1 partial sums: at most this many per segment

// torch 1.13's SGD: d = g [+ wd*p]; buf = d at step 1, else fma(d, 1-dampening, buf*momentum);
// d = nesterov ? fma(buf, momentum, d) : buf; p = fma(d, -lr, p).
template <bool kMomentum>
__global__ void __launch_bounds__(kThreads)
    sgd_kernel(const SgdCoeffs c, float* __restrict__ param, const float* __restrict__ grad,
               float* __restrict__ buffer, uint16_t* __restrict__ low, LowPrecision low_kind,
               int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += stride) {
    float p = param[i];
    float d = grad[i];
    if (c.decay) d = __fmaf_rn(p, c.weight_decay, d);
    if (kMomentum) {
      const float buf =
          c.first_step
              ? d
              : __fmaf_rn(d, c.one_minus_dampening, __fmul_rn(buffer[i], c.momentum_factor));
      buffer[i] = buf;
      d = c.nesterov ? __fmaf_rn(buf, c.momentum_factor, d) : buf;
    }
    p = __fmaf_rn(d, c.neg_lr, p);
    param[i] = p;
    cuda::store_low(low_kind, low, i, p);
  }
}

// u = (m / bc1) / (sqrt(v / bc2) + eps) [+ wd*p (fma)], as lamb_raw_update on the CPU.
__device__ __forceinline__ float lamb_update(const LambCoeffs& c, float p, float m, float v) {
  float u = __fdiv_rn(__fdiv_rn(m, c.bias_correction1),
                      __fadd_rn(__fsqrt_rn(__fdiv_rn(v, c.bias_correction2)), c.eps));
  if (c.decay) u = __fmaf_rn(p, c.weight_decay, u);
  return u;
}

// Phase 1: moments in place; per-block sums of p*p and u*u (double) into partial[2*block].
__global__ void __launch_bounds__(kThreads)
    lamb_phase1_kernel(const LambCoeffs c, const float* __restrict__ param,
                       const float* __restrict__ grad, float* __restrict__ exp_avg,
                       float* __restrict__ exp_avg_sq, int64_t n, double* __restrict__ partial) {
  double acc_p = 0, acc_u = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += stride) {
    const float g = grad[i];
    const float m = __fmaf_rn(g, c.one_minus_beta1, __fmul_rn(exp_avg[i], c.beta1));
    const float v =
        __fmaf_rn(__fmul_rn(c.one_minus_beta2, g), g, __fmul_rn(exp_avg_sq[i], c.beta2));
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    const float p = param[i];
    const float u = lamb_update(c, p, m, v);
    acc_p = __dadd_rn(acc_p, __dmul_rn(p, p));  // as the CPU's acc_sq: no fma
    acc_u = __dadd_rn(acc_u, __dmul_rn(u, u));
  }
  block_sum2(acc_p, acc_u, partial + 2 * blockIdx.x);
}

// Phase 2: p = fma(u, -lr*trust, p) with u recomputed from the updated moments.
__global__ void __launch_bounds__(kThreads)
    lamb_phase2_kernel(const LambCoeffs c, float* __restrict__ param,
                       const float* __restrict__ exp_avg, const float* __restrict__ exp_avg_sq,
                       uint16_t* __restrict__ low, LowPrecision low_kind, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += stride) {
    float p = param[i];
    p = __fmaf_rn(lamb_update(c, p, exp_avg[i], exp_avg_sq[i]), c.neg_lr_trust, p);
    param[i] = p;
    cuda::store_low(low_kind, low, i, p);
  }
}

void require(const void* p, int64_t numel, const char* fn, const char* what) {
  SHARDOPT_CHECK(p != nullptr, InvalidArgument, "kernels: {}: {} is null, expected {} elements",
                 fn, what, numel);
}

void check_common(const char* fn, int64_t numel, int64_t step, const LowPrecisionOut& low) {
  SHARDOPT_CHECK(numel >= 0, InvalidArgument, "kernels: {}: numel must be >= 0, got {}", fn,
                 numel);
  SHARDOPT_CHECK(step >= 1, InvalidArgument,
                 "kernels: {}: hyper.step is 1-based (incremented before the update), got {}", fn,
                 step);
  if (low.kind != LowPrecision::None && numel > 0) require(low.data, numel, fn, "low.data");
}

}  // namespace

void fused_sgd_cuda(const SgdHyper& hyper, const SgdSegment& s, void* stream) {
  constexpr const char* kFn = "fused_sgd_cuda";
  check_common(kFn, s.numel, hyper.step, s.low);
  if (s.numel == 0) return;
  require(s.param, s.numel, kFn, "param");
  require(s.grad, s.numel, kFn, "grad");
  const SgdCoeffs c = sgd_coeffs(hyper);
  if (c.momentum) require(s.momentum_buffer, s.numel, kFn, "momentum_buffer (momentum != 0)");
  const auto st = static_cast<cudaStream_t>(stream);
  const unsigned grid = cuda::grid_for(s.numel);
  if (c.momentum) {
    sgd_kernel<true><<<grid, kThreads, 0, st>>>(c, s.param, s.grad, s.momentum_buffer,
                                                s.low.data, s.low.kind, s.numel);
  } else {
    sgd_kernel<false><<<grid, kThreads, 0, st>>>(c, s.param, s.grad, nullptr, s.low.data,
                                                 s.low.kind, s.numel);
  }
  cuda::check(cudaGetLastError(), "launching the fused SGD kernel");
}

LambNorms fused_lamb_phase1_cuda(const LambHyper& hyper, const LambSegment& s, void* stream) {
  constexpr const char* kFn = "fused_lamb_phase1_cuda";
  check_common(kFn, s.numel, hyper.step, {});
  LambNorms norms;
  if (s.numel == 0) return norms;
  require(s.param, s.numel, kFn, "param");
  require(s.grad, s.numel, kFn, "grad");
  require(s.exp_avg, s.numel, kFn, "exp_avg");
  require(s.exp_avg_sq, s.numel, kFn, "exp_avg_sq");
  const auto st = static_cast<cudaStream_t>(stream);
  const unsigned grid = cuda::grid_for(s.numel, kNormBlocks);
  double* partial = nullptr;
  cuda::check(cudaMallocAsync(reinterpret_cast<void**>(&partial), 2 * grid * sizeof(double), st),
              "allocating LAMB's partial norms");
  lamb_phase1_kernel<<<grid, kThreads, 0, st>>>(lamb_coeffs(hyper, 1.0), s.param, s.grad,
                                                s.exp_avg, s.exp_avg_sq, s.numel, partial);
  double sums[2];
  cuda::sums2_to_host(partial, grid, st, sums, "LAMB phase 1");
  norms.param_sq = sums[0];
  norms.update_sq = sums[1];
  return norms;
}

void fused_lamb_phase2_cuda(const LambHyper& hyper, double trust_ratio, const LambSegment& s,
                            void* stream) {
  constexpr const char* kFn = "fused_lamb_phase2_cuda";
  check_common(kFn, s.numel, hyper.step, s.low);
  if (s.numel == 0) return;
  require(s.param, s.numel, kFn, "param");
  require(s.exp_avg, s.numel, kFn, "exp_avg");
  require(s.exp_avg_sq, s.numel, kFn, "exp_avg_sq");
  const auto st = static_cast<cudaStream_t>(stream);
  lamb_phase2_kernel<<<cuda::grid_for(s.numel), kThreads, 0, st>>>(
      lamb_coeffs(hyper, trust_ratio), s.param, s.exp_avg, s.exp_avg_sq, s.low.data, s.low.kind,
      s.numel);
  cuda::check(cudaGetLastError(), "launching LAMB phase 2");
}

}  // namespace shardopt::detail::kernels
