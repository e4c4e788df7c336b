/// \file
/// PipelineOptimizer: what run_pipeline (shardopt/pipeline_runner.hpp) tells the optimizer of its
/// stage about a step's backward passes, as torch pipelining's REDUCE_GRAD actions do: how many
/// there are, which chunk each one is for, and when a chunk's gradients are final (Note [Pipeline
/// handshake] in src/pipeline/runner.cpp). DistributedOptimizer implements it; hand it over as
/// PipelineRunOptions::optimizer.
#pragma once

#include <functional>

namespace shardopt {
/// What run_pipeline tells its stage's optimizer (Note [Pipeline handshake]; see the file comment).
class PipelineOptimizer {
 public:
  virtual ~PipelineOptimizer() = default;
  /// Before a run_pipeline call's first action: this rank runs `chunks` chunks of `microbatches`
  /// micro-batches, so chunks * microbatches backward passes, which are the whole step's (its
  /// gradient accumulation steps).
  virtual void begin_pipeline(int chunks, int microbatches) = 0;
  /// Runs `pass`, one backward pass of chunk `chunk` (a Backward action, or a zero-bubble weight
  /// pass, whose autograd runs are one pass; the input pass before it computes no parameter's
  /// gradient and is none). `last`: the chunk's last pass in the call, after which the gradients
  /// of its parameters are final for the step.
  virtual void chunk_backward(int chunk, bool last, const std::function<void()>& pass) = 0;
  /// After the call's last action (a call that throws ends without it; zero_grad() starts over).
  virtual void end_pipeline() = 0;
};

}  // namespace shardopt
