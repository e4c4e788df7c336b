// The fused multi-tensor CUDA kernels (Adam/AdamW, SGD, LAMB) against the CPU scalar kernel (bit
// for bit: the same operations in the same order), and AdamW against torch::optim::AdamW on the
// host and on the device (<= 1e-6).
// Skips, with the reason, where no CUDA device is visible; the argument checks run everywhere.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/fused.hpp"
#include "kernels/fused_cuda.hpp"
#include "shardopt/error.hpp"
#include "unit/kernels_support.hpp"  // normal(), first_difference(), the CPU references

namespace shardopt::detail::kernels {
namespace {

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

template <class T>
struct DeviceBuffer {
  explicit DeviceBuffer(size_t n) : n(n) {
    if (n > 0 && cudaMalloc(&ptr, n * sizeof(T)) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void upload(const std::vector<T>& host) {
    if (n > 0) cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> download() const {
    std::vector<T> host(n);
    if (n > 0) cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }
  T* ptr = nullptr;
  size_t n;
};

// One segment on both sides: host vectors for the CPU kernel, device buffers for the GPU one.
struct Segment {
  Segment(int64_t n, LowPrecision low, uint32_t seed)
      : numel(n),
        low(low),
        p(normal(n, 1.0f, seed)),
        m(n),
        v(n),
        vmax(n),
        low16(n),
        dp(n),
        dg(n),
        dm(n),
        dv(n),
        dvmax(n),
        dlow(n) {
    dp.upload(p), dm.upload(m), dv.upload(v), dvmax.upload(vmax), dlow.upload(low16);
  }
  AdamSegment host(const std::vector<float>& g, bool amsgrad) {
    return {p.data(),
            g.data(),
            m.data(),
            v.data(),
            amsgrad ? vmax.data() : nullptr,
            {low, low == LowPrecision::None ? nullptr : low16.data()},
            numel};
  }
  AdamSegment device(bool amsgrad) {
    return {dp.ptr,
            dg.ptr,
            dm.ptr,
            dv.ptr,
            amsgrad ? dvmax.ptr : nullptr,
            {low, low == LowPrecision::None ? nullptr : dlow.ptr},
            numel};
  }
  int64_t numel;
  LowPrecision low;
  std::vector<float> p, m, v, vmax;
  std::vector<uint16_t> low16;
  DeviceBuffer<float> dp, dg, dm, dv, dvmax;
  DeviceBuffer<uint16_t> dlow;
};

// First index where a and b (same length) differ in bits, or -1.
template <class T>
int64_t first_difference(const std::vector<T>& a, const std::vector<T>& b) {
  return first_difference(a.data(), b.data(), static_cast<int64_t>(a.size()));
}

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible (or no driver)";
  }

  // Runs `steps` steps over `sizes` on the GPU (one call for all segments, on `stream`) and on
  // the CPU scalar kernel, then compares every buffer bit for bit.
  void check_against_cpu(const AdamHyper& base, const std::vector<int64_t>& sizes, int steps,
                         cudaStream_t stream) {
    std::vector<std::unique_ptr<Segment>> segs;
    const LowPrecision lows[] = {LowPrecision::None, LowPrecision::BFloat16, LowPrecision::Float16};
    for (size_t i = 0; i < sizes.size(); ++i) {
      segs.push_back(std::make_unique<Segment>(sizes[i], lows[i % 3], 1000 + i));
      ASSERT_TRUE(sizes[i] == 0 || segs.back()->dp.ptr != nullptr) << "cudaMalloc failed";
    }
    for (int step = 1; step <= steps; ++step) {
      AdamHyper h = base;
      h.step = step;
      std::vector<AdamSegment> device;
      for (size_t i = 0; i < segs.size(); ++i) {
        const auto g = normal(sizes[i], 0.4f, 50 * step + i);
        segs[i]->dg.upload(g);
        raw::adam(CpuIsa::Scalar, h, segs[i]->host(g, h.amsgrad));
        device.push_back(segs[i]->device(h.amsgrad));
      }
      fused_adam_cuda(h, device.data(), static_cast<int64_t>(device.size()), stream);
      CUDA_OK(cudaStreamSynchronize(stream));
    }
    for (size_t i = 0; i < segs.size(); ++i) {
      Segment& s = *segs[i];
      SCOPED_TRACE("segment " + std::to_string(i) + " numel " + std::to_string(s.numel));
      EXPECT_EQ(first_difference(s.dp.download(), s.p), -1) << "param";
      EXPECT_EQ(first_difference(s.dm.download(), s.m), -1) << "exp_avg";
      EXPECT_EQ(first_difference(s.dv.download(), s.v), -1) << "exp_avg_sq";
      if (base.amsgrad) EXPECT_EQ(first_difference(s.dvmax.download(), s.vmax), -1) << "max";
      if (s.low != LowPrecision::None) {
        EXPECT_EQ(first_difference(s.dlow.download(), s.low16), -1) << "low copy";
      }
    }
  }
};

TEST_F(CudaKernels, MatchesCpuKernelBitwise) {
  const std::vector<int64_t> sizes = {1, 17, 0, 1000, 70001, 3 * 16384 + 5};
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  AdamHyper adamw;
  adamw.weight_decay = 0.01;
  AdamHyper adam_l2 = adamw;
  adam_l2.decoupled = false;
  AdamHyper ams = adamw;
  ams.amsgrad = true, ams.lr = 1e-2;
  for (const AdamHyper& h : {adamw, adam_l2, ams, AdamHyper{}}) {
    check_against_cpu(h, sizes, 5, stream);
  }
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST_F(CudaKernels, ManySegmentsSplitOverLaunches) {
  std::vector<int64_t> sizes;
  for (int i = 0; i < 2 * kCudaMaxSegments + 7; ++i) sizes.push_back(1 + 37 * i);
  check_against_cpu(AdamHyper{}, sizes, 2, nullptr);
}

// Ten AdamW steps of torch's own optimizer (its parameter on `device`) and of the CUDA kernel on
// the same gradients: the kernel's parameters after them, and its segment (for its bf16 copy).
struct AdamWRun {
  at::Tensor torch_param, kernel_param;
  std::vector<uint16_t> low;
};
AdamWRun adamw_against_torch(int64_t n, at::Device device, LowPrecision low, uint32_t seed,
                             uint32_t grad_seed) {
  const auto init = normal(n, 1.0f, seed);
  at::Tensor param = at::from_blob(const_cast<float*>(init.data()), {n}).to(device, false, true);
  param.set_requires_grad(true);
  const double lr = 2e-3, wd = 0.01;
  torch::optim::AdamW opt({param}, torch::optim::AdamWOptions(lr).weight_decay(wd));
  Segment seg(n, low, seed);
  for (int step = 1; step <= 10; ++step) {
    const auto g = normal(n, 0.3f, grad_seed + step);
    param.mutable_grad() = at::from_blob(const_cast<float*>(g.data()), {n}).to(device, false, true);
    opt.step();
    seg.dg.upload(g);
    AdamHyper h;
    h.lr = lr, h.weight_decay = wd, h.step = step;
    const AdamSegment d = seg.device(false);
    fused_adam_cuda(h, &d, 1);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // CUDA_OK asserts: only in void functions
  auto p = seg.dp.download();
  AdamWRun run;
  run.torch_param = param.detach().cpu();
  run.kernel_param = at::from_blob(p.data(), {n}).clone();
  if (low != LowPrecision::None) run.low = seg.dlow.download();
  return run;
}

TEST_F(CudaKernels, MatchesTorchAdamWOnHost) {
  const int64_t n = 100003;
  const AdamWRun run = adamw_against_torch(n, at::kCPU, LowPrecision::BFloat16, 9, 300);
  EXPECT_LE((run.torch_param - run.kernel_param).abs().max().item<double>(), 1e-6);
  const at::Tensor want = run.kernel_param.to(at::kBFloat16);
  EXPECT_EQ(std::memcmp(run.low.data(), want.data_ptr(), n * sizeof(uint16_t)), 0) << "bf16 copy";
}

// SGD (momentum, dampening, nesterov, weight decay) and LAMB's two phases against the CPU scalar
// kernel: elementwise results bit for bit, LAMB's norms to double rounding.
TEST_F(CudaKernels, SgdAndLambMatchCpuKernelBitwise) {
  const int64_t n = 3 * 16384 + 77;
  SgdHyper plain;
  plain.lr = 0.05;
  SgdHyper heavy = plain;
  heavy.momentum = 0.9, heavy.dampening = 0.1, heavy.weight_decay = 0.01;
  SgdHyper nesterov = heavy;
  nesterov.dampening = 0, nesterov.nesterov = true;
  for (const SgdHyper& base : {plain, heavy, nesterov}) {
    Segment seg(n, LowPrecision::Float16, 7);
    std::vector<float> buf(n, 0.0f);
    DeviceBuffer<float> dbuf(n);
    dbuf.upload(buf);
    for (int step = 1; step <= 4; ++step) {
      SgdHyper h = base;
      h.step = step;
      const auto g = normal(n, 0.4f, 70 + step);
      seg.dg.upload(g);
      raw::sgd(CpuIsa::Scalar, h, {seg.p.data(), g.data(), buf.data(), {seg.low, seg.low16.data()}, n});
      fused_sgd_cuda(h, {seg.dp.ptr, seg.dg.ptr, dbuf.ptr, {seg.low, seg.dlow.ptr}, n});
    }
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(first_difference(seg.dp.download(), seg.p), -1) << "sgd param";
    EXPECT_EQ(first_difference(seg.dlow.download(), seg.low16), -1) << "sgd fp16 copy";
    if (base.momentum != 0) EXPECT_EQ(first_difference(dbuf.download(), buf), -1) << "momentum";
  }
  LambHyper lamb;
  lamb.weight_decay = 0.01, lamb.lr = 1e-2;
  Segment seg(n, LowPrecision::BFloat16, 8);
  for (int step = 1; step <= 4; ++step) {
    lamb.step = step;
    const auto g = normal(n, 0.4f, 90 + step);
    seg.dg.upload(g);
    const LambSegment host{seg.p.data(), g.data(), seg.m.data(), seg.v.data(),
                           {seg.low, seg.low16.data()}, n};
    const LambSegment dev{seg.dp.ptr, seg.dg.ptr, seg.dm.ptr, seg.dv.ptr, {seg.low, seg.dlow.ptr}, n};
    const LambNorms want = raw::lamb_phase1(CpuIsa::Scalar, lamb, host);
    const LambNorms got = fused_lamb_phase1_cuda(lamb, dev);
    EXPECT_NEAR(got.param_sq, want.param_sq, 1e-12 * want.param_sq) << "step " << step;
    EXPECT_NEAR(got.update_sq, want.update_sq, 1e-12 * want.update_sq) << "step " << step;
    const double trust = std::sqrt(want.param_sq) / std::sqrt(want.update_sq);
    raw::lamb_phase2(CpuIsa::Scalar, lamb, trust, host);
    fused_lamb_phase2_cuda(lamb, trust, dev);
  }
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(first_difference(seg.dp.download(), seg.p), -1) << "lamb param";
  EXPECT_EQ(first_difference(seg.dm.download(), seg.m), -1) << "lamb exp_avg";
  EXPECT_EQ(first_difference(seg.dv.download(), seg.v), -1) << "lamb exp_avg_sq";
  EXPECT_EQ(first_difference(seg.dlow.download(), seg.low16), -1) << "lamb bf16 copy";
}

// torch's own AdamW on the GPU (torch 2.x: its CUDA foreach path) within 1e-6 after 10 steps.
TEST_F(CudaKernels, MatchesTorchAdamWOnCuda) {
  if (!at::hasCUDA()) GTEST_SKIP() << "this libtorch has no CUDA";
  const AdamWRun run = adamw_against_torch(100003, at::kCUDA, LowPrecision::None, 11, 400);
  EXPECT_LE((run.torch_param - run.kernel_param).abs().max().item<double>(), 1e-6);
}

// No device needed: malformed segments are refused before anything touches CUDA.
TEST(CudaKernelArguments, BadSegmentsAreNamed) {
  float x[4] = {};
  AdamSegment segs[2] = {{x, x + 1, x + 2, x + 3, nullptr, {}, 1},
                         {x, nullptr, x + 2, x + 3, nullptr, {}, 1}};
  AdamHyper h;
  try {
    fused_adam_cuda(h, segs, 2);
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("segments[1].grad is null"), std::string::npos)
        << e.what();
  }
  h.amsgrad = true;
  EXPECT_THROW(fused_adam_cuda(h, segs, 1), Error);  // no max_exp_avg_sq
  EXPECT_THROW(fused_adam_cuda(AdamHyper{}, nullptr, 3), Error);
  EXPECT_NO_THROW(fused_adam_cuda(AdamHyper{}, nullptr, 0));  // nothing to launch
}

}  // namespace
}  // namespace shardopt::detail::kernels
