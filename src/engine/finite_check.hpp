// The engine's one non-finite check, of the gradients before an update and of the master weights
// before a checkpoint: each tensor read once by the device's kernels (Note [Exact non-finite check]
// in src/kernels/finite.hpp), then one all-reduce so that every rank gives the same answer.
#pragma once

#include <ATen/core/Tensor.h>

#include "kernels/finite.hpp"
#include "shardopt/comm.hpp"

namespace shardopt::detail {

// Whether some value on some rank is NaN or +-Inf, and the sum of squares when asked.
using FiniteScan = kernels::CheckResult;

// One tensor on this rank (an undefined or empty one is finite): multiplied by float(scale) in
// place (the float product torch's mul_(scale) gives; scale 1 writes nothing), checked and, with
// `sum_squares`, its squares summed in double.
FiniteScan scan_local(const at::Tensor& t, double scale, bool sum_squares);
// Whether scan_local scales `t` inside its own pass (contiguous fp32 on a device with kernels).
bool folds_scale(const at::Tensor& t);
// Adds up scans in a fixed order, so the result does not depend on when each tensor was scanned.
void add_scan(FiniteScan& total, const FiniteScan& part);
// Every rank's totals combined by one one-element all-reduce over `agree` (null where every rank
// holds the same values).
FiniteScan agree_on(FiniteScan local, bool sum_squares, Communicator* agree, Duration timeout);

}  // namespace shardopt::detail
