/// \file
/// Mixed precision: the compute dtype of the model, where the fp32 master weights live, and the
/// dynamic loss scaler that keeps fp16 gradients representable. Torch-free.
///
/// Note [Mixed precision]
/// With ZeroOptions::precision fp16 or bf16, the model's parameters are views into a flat buffer
/// of the compute dtype (the optimizer casts fp32 parameters at construction; parameters already
/// in the compute dtype are taken as they are). The fp32 master copy and the optimizer state are
/// sharded like the state of stage 1 (whole on every rank at stage 0). Gradients are copied out of
/// autograd per bucket, reduced in fp32 (or in the compute dtype, `reduce_in_fp32 = false`) and
/// accumulated into an fp32 gradient shard, for every stage (so stage 1 shards its gradients like
/// stage 2 under mixed precision). The update steps the fp32 master shard; the result is cast back
/// into the compute-dtype parameters and all-gathered in the compute dtype.
/// fp16 multiplies the loss by the scale in DistributedOptimizer::backward(); step() divides it
/// out, and when any rank sees an Inf or NaN every rank skips the step (parameters, optimizer state
/// and the step count stay as they were) and the scaler backs off. bf16 has fp32's exponent range
/// and runs without scaling.
#pragma once

#include <cstdint>

namespace shardopt {

/// The compute dtype of the model: fp32, or fp16/bf16 with fp32 master weights (mixed precision).
enum class Precision { FP32, FP16, BF16 };
/// "fp32", "fp16" or "bf16".
const char* to_string(Precision precision);

/// DeepSpeed-style dynamic loss scaling (its defaults, except the initial scale of 2^16).
struct LossScaleOptions {
  bool dynamic = true;           ///< false: a fixed scale of initial_scale
  double initial_scale = 65536.0;  ///< the scale to start from (2^16)
  double growth_factor = 2.0;    ///< after growth_interval steps without overflow
  int growth_interval = 2000;  ///< steps without overflow before the scale grows
  double backoff_factor = 0.5;   ///< on overflow (once hysteresis is used up)
  int hysteresis = 2;            ///< overflows tolerated before the scale drops
  double min_scale = 1.0;  ///< the scale never drops below this

  /// Throws Error{InvalidArgument} naming the first invalid field.
  void validate() const;
};

/// The scaler's state machine; the optimizer calls update() once per step with whether any rank
/// saw a non-finite gradient.
class LossScaler {
 public:
  /// Starts at options.initial_scale; throws Error{InvalidArgument} on invalid options.
  explicit LossScaler(LossScaleOptions options = {});
  double scale() const { return scale_; }  ///< the current loss scale
  /// Returns true when the step must be skipped (overflow).
  bool update(bool overflow);

  /// For checkpoints.
  struct State {
    double scale = 1.0;  ///< the current scale
    int64_t good_steps = 0;  ///< steps since the last overflow or growth
    int hysteresis_left = 0;  ///< overflows still tolerated before the scale drops
    int64_t overflows = 0;  ///< overflows seen so far
  };
  /// The state to checkpoint.
  State state() const { return {scale_, good_steps_, hysteresis_left_, overflows_}; }
  void set_state(const State& state);  ///< restores a checkpointed state
  const LossScaleOptions& options() const { return options_; }  ///< the options it was built with

 private:
  LossScaleOptions options_;
  double scale_;
  int64_t good_steps_ = 0;
  int hysteresis_left_;
  int64_t overflows_ = 0;
};

}  // namespace shardopt
