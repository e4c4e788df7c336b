// The CPU implementation of the FusedKernels seam: fp32 host shards, writing a bf16/fp16 host copy
// in the same pass (a copy on a device, under offload, is cast by FlatState::write_back_master).
#include "engine/fused_kernels.hpp"

#include <ATen/ATen.h>

#include <atomic>

#include "plugins.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail {
namespace {

class CpuKernels final : public FusedKernels {
 public:
  bool accepts(const Segment& s) const override {
    const bool fp32_host = s.param.is_cpu() && s.param.scalar_type() == at::kFloat &&
                           s.grad.is_cpu() && s.grad.scalar_type() == at::kFloat;
    return fp32_host;  // a compute-dtype copy elsewhere (offload: on the GPU) is cast afterwards
  }
  void adam(const kernels::AdamHyper& h, const kernels::AdamSegment& s) const override {
    kernels::fused_adam(h, s);
  }
  void sgd(const kernels::SgdHyper& h, const kernels::SgdSegment& s) const override {
    kernels::fused_sgd(h, s);
  }
  kernels::LambNorms lamb_phase1(const kernels::LambHyper& h,
                                 const kernels::LambSegment& s) const override {
    return kernels::fused_lamb_phase1(h, s);
  }
  void lamb_phase2(const kernels::LambHyper& h, double trust_ratio,
                   const kernels::LambSegment& s) const override {
    kernels::fused_lamb_phase2(h, trust_ratio, s);
  }
  kernels::CheckResult check_finite(const kernels::CheckSegment& s,
                                    const kernels::CheckOptions& o) const override {
    return kernels::check_finite(s, o);
  }
};

std::atomic<const FusedKernels*>& cuda_slot() {
  static std::atomic<const FusedKernels*> slot{nullptr};
  return slot;
}

}  // namespace

const FusedKernels* fused_kernels_for(c10::DeviceType device) {
  static const CpuKernels cpu;
  if (device == c10::DeviceType::CPU) return &cpu;
  if (device != c10::DeviceType::CUDA) return nullptr;
  if (cuda_slot().load() == nullptr) (void)load_plugin("shardopt_cuda");  // registers itself
  return cuda_slot().load();  // null without it: torch's ops step CUDA shards
}

void register_fused_kernels(c10::DeviceType device, const FusedKernels* kernels) {
  SHARDOPT_INTERNAL_ASSERT(device == c10::DeviceType::CUDA,
                           "fused kernels can only be registered for CUDA, got {}",
                           c10::DeviceTypeName(device));
  cuda_slot().store(kernels);
}

}  // namespace shardopt::detail
