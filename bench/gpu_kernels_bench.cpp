// The fused CUDA optimizer kernels against the device's copy bandwidth, on --numel fp32
// parameters (default 1e8): AdamW moves 28 bytes per parameter (reads p, g, m, v; writes p, m, v),
// a device-to-device copy of B bytes moves 2B. Times with CUDA events, median of --reps after
// --warmup; prints one JSON object (bench/gpu_adamw_peer.py times torch's fused AdamW alike).
// Without a device it prints {"skipped": "..."} and exits 0.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/fused_cuda.hpp"

namespace {

using shardopt::detail::kernels::AdamHyper;
using shardopt::detail::kernels::AdamSegment;

void check(cudaError_t rc, const char* what) {
  if (rc == cudaSuccess) return;
  std::fprintf(stderr, "gpu_kernels_bench: %s: %s\n", what, cudaGetErrorString(rc));
  std::exit(1);
}

// Median milliseconds of fn() over `reps` timed runs on the legacy default stream.
double median_ms(const std::function<void()>& fn, int warmup, int reps) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    check(cudaEventRecord(start), "cudaEventRecord");
    fn();
    check(cudaEventRecord(stop), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float t = 0;
    check(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

long long arg(int argc, char** argv, const char* name, long long fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoll(argv[i + 1]);
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = arg(argc, argv, "--numel", 100000000);
  const int warmup = static_cast<int>(arg(argc, argv, "--warmup", 3));
  const int reps = static_cast<int>(arg(argc, argv, "--reps", 20));
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("{\"skipped\": \"no CUDA device visible\"}\n");
    return 0;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  float *p, *g, *m, *v, *copy_dst;
  uint16_t* low;
  for (float** buf : {&p, &g, &m, &v, &copy_dst}) {
    check(cudaMalloc(buf, bytes), "cudaMalloc");
    check(cudaMemset(*buf, 0, bytes), "cudaMemset");
  }
  check(cudaMalloc(&low, static_cast<size_t>(n) * 2), "cudaMalloc");
  // Moderate values: a parameter of 0.01 and a gradient of 0.001 everywhere (0x3C23D70A etc.).
  std::vector<float> host(1 << 20, 0.01f);
  for (size_t off = 0; off < bytes; off += host.size() * sizeof(float)) {
    const size_t chunk = std::min(bytes - off, host.size() * sizeof(float));
    check(cudaMemcpy(reinterpret_cast<char*>(p) + off, host.data(), chunk, cudaMemcpyHostToDevice),
          "upload");
    check(cudaMemcpy(reinterpret_cast<char*>(g) + off, host.data(), chunk, cudaMemcpyHostToDevice),
          "upload");
  }
  AdamHyper h;
  h.lr = 1e-4, h.weight_decay = 0.01;
  int64_t step = 0;
  auto adamw = [&](bool with_low) {
    return [&, with_low] {
      h.step = ++step;
      const AdamSegment s{p, g, m, v, nullptr,
                          {with_low ? shardopt::detail::kernels::LowPrecision::BFloat16
                                    : shardopt::detail::kernels::LowPrecision::None,
                           with_low ? low : nullptr},
                          n};
      shardopt::detail::kernels::fused_adam_cuda(h, &s, 1, nullptr);
    };
  };
  const double copy_ms = median_ms(
      [&] { check(cudaMemcpyAsync(copy_dst, p, bytes, cudaMemcpyDeviceToDevice), "copy"); },
      warmup, reps);
  const double adamw_ms = median_ms(adamw(false), warmup, reps);
  const double adamw_bf16_ms = median_ms(adamw(true), warmup, reps);
  check(cudaDeviceSynchronize(), "the timed kernels");
  const double copy_gbs = 2.0 * bytes / (copy_ms * 1e6);
  const double adamw_gbs = 28.0 * n / (adamw_ms * 1e6);
  const double adamw_bf16_gbs = 30.0 * n / (adamw_bf16_ms * 1e6);
  std::printf(
      "{\"device\": \"%s\", \"numel\": %lld, \"reps\": %d,\n"
      " \"d2d_copy_ms\": %.4f, \"d2d_copy_GBps\": %.1f,\n"
      " \"fused_adamw_ms\": %.4f, \"fused_adamw_GBps\": %.1f, \"fused_adamw_Gparam_per_s\": %.2f,\n"
      " \"fused_adamw_bf16_copy_ms\": %.4f, \"fused_adamw_bf16_copy_GBps\": %.1f,\n"
      " \"adamw_fraction_of_copy_bandwidth\": %.3f}\n",
      prop.name, static_cast<long long>(n), reps, copy_ms, copy_gbs, adamw_ms, adamw_gbs,
      n / (adamw_ms * 1e6), adamw_bf16_ms, adamw_bf16_gbs, adamw_gbs / copy_gbs);
  for (void* buf : {static_cast<void*>(p), static_cast<void*>(g), static_cast<void*>(m),
                    static_cast<void*>(v), static_cast<void*>(copy_dst), static_cast<void*>(low)}) {
    cudaFree(buf);
  }
  return 0;
}
