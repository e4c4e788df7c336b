// ZeroOptions validation and precision names.
#include "shardopt/options.hpp"

#include "shardopt/detail/names.hpp"
#include "shardopt/error.hpp"

namespace shardopt {

const char* to_string(Precision precision) { return detail::precision_name(precision); }

Precision parse_precision(const std::string& text) {
  if (const auto p = detail::precision_named(text)) return *p;
  SHARDOPT_FAIL(InvalidArgument, "options: precision must be one of fp32, fp16, bf16, got '{}'",
                text);
}

Stage stage_from_int(int stage) {
  SHARDOPT_CHECK(stage >= 0 && stage <= 3, InvalidArgument,
                 "options: stage must be 0, 1, 2 or 3, got {}", stage);
  return static_cast<Stage>(stage);
}

void ZeroOptions::validate() const {
  stage_from_int(to_int(stage));
  SHARDOPT_CHECK(bucket_bytes >= 0, InvalidArgument,
                 "options: bucket_bytes must be >= 0 (0: sized from the model), got {}",
                 bucket_bytes);
  SHARDOPT_CHECK(grad_accumulation_steps >= 1, InvalidArgument,
                 "options: grad_accumulation_steps must be at least 1, got {}",
                 grad_accumulation_steps);
  SHARDOPT_CHECK(max_grad_norm >= 0.0, InvalidArgument,
                 "options: max_grad_norm must be >= 0 (0 disables clipping), got {}", max_grad_norm);
  SHARDOPT_CHECK(align_bytes > 0 && (align_bytes & (align_bytes - 1)) == 0, InvalidArgument,
                 "options: align_bytes must be a positive power of two, got {}", align_bytes);
  SHARDOPT_CHECK(prefetch >= 0, InvalidArgument, "options: prefetch must be >= 0, got {}",
                 prefetch);
  SHARDOPT_CHECK(!grid.embedding || grid.pp, InvalidArgument,
                 "options: grid.embedding is set but grid.pp is null (pass make_parallel_groups' "
                 "groups whole)");
  SHARDOPT_CHECK(reuse_distance >= 0, InvalidArgument,
                 "options: reuse_distance must be >= 0 (unit uses ahead), got {}", reuse_distance);
  SHARDOPT_CHECK(shard_group_size >= 0, InvalidArgument,
                 "options: shard_group_size must be >= 0 (0: all ranks), got {}", shard_group_size);
  SHARDOPT_CHECK(reduce_dtype == Precision::FP32 || reduce_in_fp32 || precision == Precision::FP32 ||
                     reduce_dtype == precision,
                 InvalidArgument,
                 "options: reduce_dtype {} contradicts reduce_in_fp32 = false, which reduces in "
                 "the compute dtype {}; set one of them",
                 to_string(reduce_dtype), to_string(precision));
  SHARDOPT_CHECK(max_nonfinite_steps >= 0, InvalidArgument,
                 "options: max_nonfinite_steps must be >= 0 (0: never throw), got {}",
                 max_nonfinite_steps);
  SHARDOPT_CHECK(timeout > Duration::zero(), InvalidArgument,
                 "options: timeout must be positive, got {} ms", timeout.count());
  loss_scale.validate();
  unit_policy.validate();
}

}  // namespace shardopt
