// The engine's one non-finite check, for the gradients before an update (LocalUpdate) and for the
// master weights before a checkpoint (Engine::parameters_finite): each tensor read once by the
// device's kernels (Note [Exact non-finite check] in src/kernels/finite.hpp), fp32 gradients
// unscaled in the same pass and their squares summed for clipping, then one all-reduce so that
// every rank gives the same answer.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "kernels/finite.hpp"
#include "shardopt/comm.hpp"

namespace shardopt::detail {

// Whether some value on some rank is NaN or +-Inf, and the sum of squares when asked.
using FiniteScan = kernels::CheckResult;

// Multiplies each tensor by float(scale) in place (the float product torch's mul_(scale) gives;
// scale 1 writes nothing), finds whether any value is non-finite and, with `sum_squares`, sums the
// squares in double. With `agree` (a communicator of more than one rank) every rank's results are
// combined by one one-element all-reduce; pass null where every rank holds the same values.
FiniteScan scan_finite(const std::vector<at::Tensor>& tensors, double scale, bool sum_squares,
                       Communicator* agree, Duration timeout);
// Whether scan_finite scales `t` inside its own pass (contiguous fp32 on a device with kernels).
bool folds_scale(const at::Tensor& t);

// scan_finite's two halves, for callers that scan tensors at different times: one tensor on this
// rank (an undefined or empty one is finite), and the combination of every rank's totals (added up
// by add_scan in a fixed order, so the result does not depend on when each tensor was scanned).
FiniteScan scan_local(const at::Tensor& t, double scale, bool sum_squares);
void add_scan(FiniteScan& total, const FiniteScan& part);
FiniteScan agree_on(FiniteScan local, bool sum_squares, Communicator* agree, Duration timeout);

}  // namespace shardopt::detail
