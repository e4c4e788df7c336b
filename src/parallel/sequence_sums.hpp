// Who sums a sequence-parallel parameter's gradient over its tensor group (Note [Sequence-parallel
// sums] in src/parallel/split_record.cpp): the hook mark_sequence_parallel registers, unless a
// DistributedOptimizer has claimed the parameter, which then sums once a step in FinalizeGrads.
#pragma once

#include <ATen/core/Tensor.h>

namespace shardopt::detail {

// The optimizer sums `param`'s gradient from now on; the hook leaves it alone. Thread-safe.
void claim_sequence_sum(const at::Tensor& param);
// Undoes claim_sequence_sum (the optimizer is gone): the hook sums again.
void release_sequence_sum(const at::Tensor& param);

}  // namespace shardopt::detail
