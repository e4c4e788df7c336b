// The engine's one non-finite check, for the gradients before an update (LocalUpdate) and for the
// master weights before a checkpoint (Engine::parameters_finite): each tensor read once by the
// device's kernels (Note [Exact non-finite check] in src/kernels/finite.hpp), fp32 gradients
// unscaled in the same pass and their squares summed for clipping, then one all-reduce so that
// every rank gives the same answer.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "shardopt/comm.hpp"

namespace shardopt::detail {

struct FiniteScan {
  bool non_finite = false;  // some value on some rank is NaN or +-Inf
  double sum_sq = 0.0;      // sum of squares over every rank's tensors, when asked
};

// Multiplies each tensor by float(scale) in place (the float product torch's mul_(scale) gives;
// scale 1 writes nothing), finds whether any value is non-finite and, with `sum_squares`, sums the
// squares in double. With `agree` (a communicator of more than one rank) the results of every rank
// are combined by one one-element all-reduce (the sum of squares, or the flag's maximum); pass
// null where every rank holds the same values.
// Contiguous fp32/bf16/fp16 tensors on a device with kernels (the CPU; CUDA with libshardopt_cuda)
// take one pass; others fall back on torch's operations.
// Whether scan_finite scales `t` inside its own pass (contiguous fp32 on a device with kernels).
bool folds_scale(const at::Tensor& t);

FiniteScan scan_finite(const std::vector<at::Tensor>& tensors, double scale, bool sum_squares,
                       Communicator* agree, Duration timeout);

// scan_finite's two halves, for callers that scan tensors at different times: one tensor on this
// rank (scaled as above; an undefined or empty one is finite), and the combination of every
// rank's totals (added up by add_scan in a fixed order, so the result does not depend on when
// each tensor was scanned).
FiniteScan scan_local(const at::Tensor& t, double scale, bool sum_squares);
void add_scan(FiniteScan& total, const FiniteScan& part);
FiniteScan agree_on(FiniteScan local, bool sum_squares, Communicator* agree, Duration timeout);

}  // namespace shardopt::detail
