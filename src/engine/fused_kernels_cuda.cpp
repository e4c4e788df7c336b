// The CUDA implementation of the FusedKernels seam (libshardopt_cuda): fp32 device shards and
// their bf16/fp16 device copy, stepped by the kernels of fused_cuda.hpp in torch's stream order
// (Note [Torch's default stream] in torch_stream.hpp): no host synchronisation, except that
// LAMB's phase 1 returns its norms. Registers itself when the library is loaded.
#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>

#include <array>
#include <mutex>

#include "engine/fused_kernels.hpp"
#include "kernels/fused_cuda.hpp"
#include "shardopt/error.hpp"
#include "torch_stream.hpp"

namespace shardopt::detail {
namespace {

constexpr int kMaxDevices = 64;

// Where one segment's kernels run: the device its parameters live on (set as current for the
// launch and restored after) and a stream ordered after torch's current stream there.
class Launch {
 public:
  explicit Launch(const void* param) {
    cudaPointerAttributes attr{};
    check(cudaPointerGetAttributes(&attr, param), "cudaPointerGetAttributes");
    SHARDOPT_CHECK(attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged,
                   InvalidArgument, "kernels: a CUDA shard's parameters are not device memory");
    device_ = attr.device;
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device_) check(cudaSetDevice(device_), "cudaSetDevice");
    if (!is_torch_default_stream(torch_current_stream(device_))) {
      stream_ = side_stream(device_);
      stream_waits_for_torch(stream_, device_, "kernels");
    }
  }
  ~Launch() {
    if (stream_ != nullptr) {
      try {
        torch_waits_for_stream(stream_, device_, "kernels");
      } catch (...) {  // a destructor must not throw; the launch error was reported already
      }
    }
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  Launch(const Launch&) = delete;
  Launch& operator=(const Launch&) = delete;
  void* stream() const { return stream_; }

 private:
  static void check(cudaError_t rc, const char* what) {
    SHARDOPT_CHECK(rc == cudaSuccess, Internal, "kernels: {} failed: {}", what,
                   cudaGetErrorString(rc));
  }
  // One non-blocking stream per device for work on a non-default torch stream, created once.
  static cudaStream_t side_stream(int device) {
    static std::mutex mutex;
    static std::array<cudaStream_t, kMaxDevices> streams{};
    SHARDOPT_CHECK(device >= 0 && device < kMaxDevices, Unsupported,
                   "kernels: CUDA device {} is beyond the {} supported", device, kMaxDevices);
    std::lock_guard<std::mutex> lock(mutex);
    if (streams[device] == nullptr) {
      check(cudaStreamCreateWithFlags(&streams[device], cudaStreamNonBlocking),
            "cudaStreamCreateWithFlags");
    }
    return streams[device];
  }

  int device_ = 0;
  int previous_ = 0;
  cudaStream_t stream_ = nullptr;
};

class CudaKernels final : public FusedKernels {
 public:
  bool accepts(const Segment& s) const override {
    const bool fp32_device = s.param.is_cuda() && s.param.scalar_type() == at::kFloat &&
                             s.grad.is_cuda() && s.grad.scalar_type() == at::kFloat &&
                             s.grad.device() == s.param.device();
    return fp32_device;  // a copy the kernels cannot write is cast afterwards
  }
  void adam(const kernels::AdamHyper& h, const kernels::AdamSegment& s) const override {
    if (s.numel == 0) return;
    Launch launch(s.param);
    kernels::fused_adam_cuda(h, &s, 1, launch.stream());
  }
  void sgd(const kernels::SgdHyper& h, const kernels::SgdSegment& s) const override {
    if (s.numel == 0) return;
    Launch launch(s.param);
    kernels::fused_sgd_cuda(h, s, launch.stream());
  }
  kernels::LambNorms lamb_phase1(const kernels::LambHyper& h,
                                 const kernels::LambSegment& s) const override {
    if (s.numel == 0) return {};
    Launch launch(s.param);
    return kernels::fused_lamb_phase1_cuda(h, s, launch.stream());
  }
  void lamb_phase2(const kernels::LambHyper& h, double trust_ratio,
                   const kernels::LambSegment& s) const override {
    if (s.numel == 0) return;
    Launch launch(s.param);
    kernels::fused_lamb_phase2_cuda(h, trust_ratio, s, launch.stream());
  }
  kernels::CheckResult check_finite(const kernels::CheckSegment& s,
                                    const kernels::CheckOptions& o) const override {
    if (s.numel == 0) return {};
    Launch launch(s.data);
    return kernels::check_finite_cuda(s, o, launch.stream());
  }
};

const CudaKernels kCudaKernels;

// Loading the library registers the kernels (fused_kernels_for loads it on first need).
const bool kRegistered = [] {
  register_fused_kernels(c10::DeviceType::CUDA, &kCudaKernels);
  return true;
}();

}  // namespace

// For applications and tests that link libshardopt_cuda directly: a symbol to reference, so the
// linker keeps the library (and its registration) even with --as-needed.
const FusedKernels* cuda_fused_kernels() { return kRegistered ? &kCudaKernels : nullptr; }

}  // namespace shardopt::detail
