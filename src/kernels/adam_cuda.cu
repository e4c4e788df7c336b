// Fused multi-tensor Adam/AdamW on the GPU. One launch covers up to kCudaMaxSegments segments:
// block b finds its segment from the chunk prefix sums in the kernel arguments (no device-side
// metadata, no allocation), then updates one chunk of kChunk elements. Every operation is an
// explicit round-to-nearest intrinsic, so nvcc fuses nothing the CPU kernels do not fuse.
#include "kernels/cpu_kernels.hpp"
#include "kernels/cuda_common.cuh"
#include "kernels/fused_cuda.hpp"

namespace shardopt::detail::kernels {
namespace {

using cuda::bf16_bits;
using cuda::fp16_bits;
using cuda::kThreads;
constexpr int64_t kChunk = 64 * kThreads;  // elements per block

struct LaunchArgs {
  AdamCoeffs c;
  int count;
  float* param[kCudaMaxSegments];
  const float* grad[kCudaMaxSegments];
  float* exp_avg[kCudaMaxSegments];
  float* exp_avg_sq[kCudaMaxSegments];
  float* max_exp_avg_sq[kCudaMaxSegments];
  uint16_t* low[kCudaMaxSegments];
  LowPrecision low_kind[kCudaMaxSegments];
  int64_t numel[kCudaMaxSegments];
  int64_t chunk_begin[kCudaMaxSegments + 1];  // prefix sums of the segments' chunk counts
};

__device__ __forceinline__ float max_nan(float a, float b) {
  if (isnan(a) || isnan(b)) return __int_as_float(-1);  // as the CPU kernels
  return a > b ? a : b;
}

template <int kDecay, bool kAmsgrad>
__global__ void __launch_bounds__(kThreads) adam_kernel(const LaunchArgs a) {
  const int64_t block = blockIdx.x;
  int t = 0;
  while (block >= a.chunk_begin[t + 1]) ++t;
  const int64_t begin = (block - a.chunk_begin[t]) * kChunk;
  const int64_t end = min(a.numel[t], begin + kChunk);
  float* __restrict__ param = a.param[t];
  const float* __restrict__ grad = a.grad[t];
  float* __restrict__ exp_avg = a.exp_avg[t];
  float* __restrict__ exp_avg_sq = a.exp_avg_sq[t];
  float* __restrict__ max_exp_avg_sq = a.max_exp_avg_sq[t];
  uint16_t* __restrict__ low = a.low[t];
  const LowPrecision low_kind = a.low_kind[t];
  const AdamCoeffs& c = a.c;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    float p = param[i];
    float g = grad[i];
    if (kDecay == AdamCoeffs::kDecayParam) p = __fmul_rn(p, c.decay_param);
    if (kDecay == AdamCoeffs::kDecayGrad) g = __fmaf_rn(p, c.decay_grad, g);
    const float m = __fmaf_rn(g, c.one_minus_beta1, __fmul_rn(exp_avg[i], c.beta1));
    const float v =
        __fmaf_rn(__fmul_rn(c.one_minus_beta2, g), g, __fmul_rn(exp_avg_sq[i], c.beta2));
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    float s = v;
    if (kAmsgrad) {
      s = max_nan(v, max_exp_avg_sq[i]);
      max_exp_avg_sq[i] = s;
    }
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(s), c.sqrt_bias_correction2), c.eps);
    p = __fadd_rn(p, __fdiv_rn(__fmul_rn(c.neg_step_size, m), denom));
    param[i] = p;
    if (low_kind == LowPrecision::BFloat16) low[i] = bf16_bits(p);
    if (low_kind == LowPrecision::Float16) low[i] = fp16_bits(p);
  }
}

template <int kDecay, bool kAmsgrad>
void launch(const LaunchArgs& a, int64_t blocks, cudaStream_t stream) {
  adam_kernel<kDecay, kAmsgrad><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
}

void check_segment(const AdamHyper& hyper, const AdamSegment& s, int64_t index) {
  SHARDOPT_CHECK(s.numel >= 0, InvalidArgument,
                 "kernels: fused_adam_cuda: segments[{}].numel must be >= 0, got {}", index,
                 s.numel);
  if (s.numel == 0) return;
  const std::pair<const void*, const char*> buffers[] = {
      {s.param, "param"},
      {s.grad, "grad"},
      {s.exp_avg, "exp_avg"},
      {s.exp_avg_sq, "exp_avg_sq"},
      {hyper.amsgrad ? s.max_exp_avg_sq : s.param, "max_exp_avg_sq (amsgrad)"},
      {s.low.kind != LowPrecision::None ? static_cast<const void*>(s.low.data) : s.param,
       "low.data"}};
  for (const auto& [p, what] : buffers) {
    SHARDOPT_CHECK(p != nullptr, InvalidArgument,
                   "kernels: fused_adam_cuda: segments[{}].{} is null, expected {} elements", index,
                   what, s.numel);
  }
}

}  // namespace

void fused_adam_cuda(const AdamHyper& hyper, const AdamSegment* segments, int64_t count,
                     void* stream) {
  SHARDOPT_CHECK(count >= 0 && (segments != nullptr || count == 0), InvalidArgument,
                 "kernels: fused_adam_cuda: expected count >= 0 segments at a non-null pointer, "
                 "got count {} at {}",
                 count, static_cast<const void*>(segments));
  SHARDOPT_CHECK(hyper.step >= 1, InvalidArgument,
                 "kernels: fused_adam_cuda: hyper.step is 1-based (incremented before the "
                 "update), got {}",
                 hyper.step);
  for (int64_t i = 0; i < count; ++i) check_segment(hyper, segments[i], i);

  LaunchArgs a{};
  a.c = adam_coeffs(hyper);
  const auto st = static_cast<cudaStream_t>(stream);
  int64_t blocks = 0;
  auto flush = [&] {
    if (a.count == 0) return;
    a.chunk_begin[a.count] = blocks;
    switch (a.c.decay) {
      case AdamCoeffs::kNoDecay:
        a.c.amsgrad ? launch<AdamCoeffs::kNoDecay, true>(a, blocks, st)
                    : launch<AdamCoeffs::kNoDecay, false>(a, blocks, st);
        break;
      case AdamCoeffs::kDecayParam:
        a.c.amsgrad ? launch<AdamCoeffs::kDecayParam, true>(a, blocks, st)
                    : launch<AdamCoeffs::kDecayParam, false>(a, blocks, st);
        break;
      case AdamCoeffs::kDecayGrad:
        a.c.amsgrad ? launch<AdamCoeffs::kDecayGrad, true>(a, blocks, st)
                    : launch<AdamCoeffs::kDecayGrad, false>(a, blocks, st);
        break;
    }
    cuda::check(cudaGetLastError(), "launching the fused Adam kernel");
    a.count = 0;
    blocks = 0;
  };
  constexpr int64_t kMaxBlocks = 0x7FFFFFFF;  // gridDim.x limit
  for (int64_t i = 0; i < count; ++i) {
    const AdamSegment& s = segments[i];
    if (s.numel == 0) continue;
    const int64_t chunks = (s.numel + kChunk - 1) / kChunk;
    SHARDOPT_CHECK(chunks <= kMaxBlocks, InvalidArgument,
                   "kernels: fused_adam_cuda: segments[{}] has {} elements, more than one launch "
                   "covers ({})",
                   i, s.numel, kMaxBlocks * kChunk);
    if (blocks + chunks > kMaxBlocks) flush();
    const int k = a.count++;
    a.param[k] = s.param;
    a.grad[k] = s.grad;
    a.exp_avg[k] = s.exp_avg;
    a.exp_avg_sq[k] = s.exp_avg_sq;
    a.max_exp_avg_sq[k] = s.max_exp_avg_sq;
    a.low[k] = s.low.data;
    a.low_kind[k] = s.low.kind;
    a.numel[k] = s.numel;
    a.chunk_begin[k] = blocks;
    blocks += chunks;
    if (a.count == kCudaMaxSegments) flush();
  }
  flush();
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return n;
}

}  // namespace shardopt::detail::kernels
