// FusedKernels: the seam where one device's fused one-pass kernels (src/kernels, raw pointers) plug
// into the local update. The CPU kernels are built in; the CUDA ones (fused_kernels_cuda.cpp,
// libshardopt_cuda) register themselves when fused_kernels_for(CUDA) loads the library. Where no
// kernels accept a segment, torch's ops step it (RuleStep).
#pragma once

#include <c10/core/DeviceType.h>

#include "engine/flat_state.hpp"
#include "kernels/finite.hpp"
#include "kernels/fused.hpp"

namespace shardopt::detail {

class FusedKernels {
 public:
  virtual ~FusedKernels() = default;
  // Whether these kernels can step the segment: device and dtypes of the master weights and
  // gradients.
  virtual bool accepts(const Segment& s) const = 0;
  virtual void adam(const kernels::AdamHyper& h, const kernels::AdamSegment& s) const = 0;
  virtual void sgd(const kernels::SgdHyper& h, const kernels::SgdSegment& s) const = 0;
  virtual kernels::LambNorms lamb_phase1(const kernels::LambHyper& h,
                                         const kernels::LambSegment& s) const = 0;
  virtual void lamb_phase2(const kernels::LambHyper& h, double trust_ratio,
                           const kernels::LambSegment& s) const = 0;
  // The non-finite check (kernels/finite.hpp) over memory of this device; waits for its result.
  virtual kernels::CheckResult check_finite(const kernels::CheckSegment& s,
                                            const kernels::CheckOptions& o) const = 0;
};

// The compute-dtype copy of an accepted segment from element `begin`, when it is bf16/fp16 on the
// segment's device, where the kernels write it in the same pass; otherwise none (kind None without
// a separate master, or for a copy on another device), and it is cast afterwards.
inline kernels::LowPrecisionOut low_out(const Segment& s, int64_t begin) {
  kernels::LowPrecisionOut out;
  if (!s.low.defined() || s.low.device() != s.param.device()) return out;
  const auto dtype = s.low.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return out;
  out.kind = dtype == at::kBFloat16 ? kernels::LowPrecision::BFloat16
                                    : kernels::LowPrecision::Float16;
  out.data = reinterpret_cast<uint16_t*>(s.low.data_ptr()) + begin;
  return out;
}

// The kernels for shards on `device`, or null where none are built.
const FusedKernels* fused_kernels_for(c10::DeviceType device);
// Registers `kernels` (static lifetime) for shards on `device`; called by libshardopt_cuda.
void register_fused_kernels(c10::DeviceType device, const FusedKernels* kernels);
// The CUDA kernels, defined in libshardopt_cuda (link it to call this; loading registers them).
const FusedKernels* cuda_fused_kernels();

}  // namespace shardopt::detail
