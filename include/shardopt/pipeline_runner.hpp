/// \file
/// Runs a compiled pipeline schedule (shardopt/pipeline.hpp) on this rank: its chunks' forward
/// functions, autograd for the backward passes, the communicator's send/recv between stages, and
/// gradient accumulation over the micro-batches into the parameters' .grad.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "shardopt/comm.hpp"
#include "shardopt/pipeline.hpp"
#include "shardopt/pipeline_optimizer.hpp"

namespace shardopt {

/// Records that the first and the last pipeline stage each hold a copy of `param`, a tied word
/// embedding (the lookup on the first, the decoder on the last): DistributedOptimizer, given the
/// grid (ZeroOptions::grid), makes both copies start as the first stage's and sums their gradients
/// over the grid's embedding group before each update, so they stay equal (Note [Finalizing
/// gradients over the grid] in src/engine/finalize_grads.cpp). A model marks the tensor whatever
/// the layout: without pipelines the mark means nothing. Like a split record it stays on the
/// tensor (through module.to(), not clone()). Local; thread-safe.
void mark_pipeline_shared(const at::Tensor& param);
/// Whether `param` was marked with mark_pipeline_shared.
bool is_pipeline_shared(const at::Tensor& param);

/// One chunk (model stage) on this rank: a function of tensors, e.g. a lambda over a
/// torch::nn::Module's forward. Set `forward` (one tensor in, one out) or `forward_tensors`
/// (several tensors per boundary: hidden states, a mask, ...).
struct PipelineChunk {
  /// forward(input, microbatch): input is the micro-batch's data on stage 0 and the previous
  /// stage's activation (a leaf that requires grad) elsewhere. The last stage returns the
  /// micro-batch's loss, a scalar whose backward is what a single process would call.
  std::function<at::Tensor(const at::Tensor& input, int microbatch)> forward;
  /// The chunk's parameters. ZB-H1's weight pass computes their gradients and those of every other
  /// leaf of the chunk's graph that requires grad (Note [Owed gradients] in
  /// src/pipeline/split_backward.hpp), so a parameter missing here still gets its gradient; listing
  /// them fixes the order in which the weight pass produces theirs.
  std::vector<at::Tensor> parameters;
  /// Used instead of `forward` when set: forward_tensors(inputs, microbatch) gets {data} on stage 0
  /// and every tensor the previous stage returned elsewhere (floating ones as leaves requiring
  /// grad), and returns the tensors for the next stage ({loss} on the last). Their number, shapes
  /// and dtypes are agreed on the first micro-batch (PipelineRunOptions::activation_shape empty)
  /// and must not change afterwards; only floating tensors carry a gradient back.
  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs, int microbatch)>
      forward_tensors;
};

/// When and how long one action of this rank's list ran (PipelineRunOptions::trace).
struct PipelineActionTiming {
  int64_t start_ns = 0;    ///< steady clock (CLOCK_MONOTONIC on Linux: one clock for every
  int64_t end_ns = 0;      ///< process of a host), nanoseconds since its epoch
  int64_t cpu_ns = 0;      ///< this thread's CPU time in the action (CLOCK_THREAD_CPUTIME_ID)
  int64_t live_bytes = 0;  ///< MemoryTracker::cpu().live_bytes() after the action and the release
                           ///< of what it was the last use of (0 growth while not installed)
};

/// The timings of one run_pipeline() call: actions[i] is this rank's schedule.actions[rank][i].
/// Costs two clock reads of each kind and an atomic load per action; nothing when not asked for.
struct PipelineTrace {
  std::vector<PipelineActionTiming> actions;  ///< per action of this rank's list, in order
  int64_t live_bytes_before = 0;  ///< MemoryTracker::cpu().live_bytes() when the call began
};

/// How run_pipeline() runs a rank's list.
struct PipelineRunOptions {
  /// Shape of the one activation between stages (and of its gradient), as Megatron's
  /// tensor_shape: receives are posted into tensors of this shape and activation_dtype, and a
  /// stage returning anything else is an error. Empty: each boundary's tensors (several with
  /// forward_tensors) are agreed on its first micro-batch, the sender sending their number, dtypes
  /// and shapes ahead of them (Note [Boundary headers] in src/pipeline/runner.cpp; torch
  /// pipelining's shape inference), and activation_dtype is not used.
  std::vector<int64_t> activation_shape;
  at::ScalarType activation_dtype = at::kFloat;  ///< dtype of the activations and their gradients
  /// Where they live: receives are posted on this device and stages must return tensors on it (a
  /// CUDA device: the engine must serve CUDA tensors, as NCCL and the thread engine do).
  c10::Device activation_device = c10::kCPU;
  /// Where to record each action's timing (overwritten on every call); null: no timing.
  PipelineTrace* trace = nullptr;
  /// The optimizer of this rank's stage (DistributedOptimizer), told when the step's backward
  /// passes run and when each chunk's are over (Note [Pipeline handshake] in
  /// src/pipeline/runner.cpp): it takes the step's v*m passes from the call (no
  /// grad_accumulation_steps to set), counts a zero-bubble weight pass as one and reduces each
  /// bucket once a step. Null: the optimizer sees autograd alone (then set
  /// grad_accumulation_steps = v*m and wrap the weight pass below).
  PipelineOptimizer* optimizer = nullptr;
  /// Runs a zero-bubble weight pass, given as a function: it takes one autograd run per split
  /// node, which an optimizer counting backward passes must count as one. Not needed with
  /// `optimizer`, which does it. Empty: run it.
  std::function<void(const std::function<void()>& pass)> weight_pass;
  // Note [Batched exchanges] (shardopt/pipeline.hpp): each run of sends and receives between two
  // compute passes goes as one batch_isend_irecv, for every schedule. Auto: where the engine
  // needs it (NCCL); Always: on any engine (tests run it on MPI, Gloo and threads); Never: each
  // message alone (isend, blocking recv). The results are the same bitwise either way.
  /// When the messages between two compute passes go as one batch (Note [Batched exchanges]).
  enum class Batching { Auto, Never, Always };
  using Pairing = Batching;  ///< the former name
  Batching batch_exchanges = Batching::Auto;  ///< Auto: where the engine needs it (NCCL)
  /// The former name of batch_exchanges (it paired a send with the receive after it, which
  /// deadlocked interleaved 1F1B with m > p); read only while batch_exchanges is Auto.
  Batching pair_exchanges = Batching::Auto;
};

/// Runs rank comm.rank()'s list of `schedule` (its ranks must equal comm.size()). Before any
/// message, each rank validates the schedule (validate_schedule) and its own arguments, and the
/// ranks all-gather the schedule's fingerprint() and the outcome: ranks handed different
/// schedules stop with Error{Mismatch} naming which rank got which, an invalid schedule or call
/// with its Error on every rank, never a hang (one small all-gather per call). `chunks` holds
/// this rank's v chunks in chunk order; `data(microbatch)` gives stage 0's inputs (called on the
/// rank that holds stage 0 only). Gradients accumulate into the parameters' .grad as the
/// micro-batches' backward passes run, in micro-batch order on every stage, so fp32 results are
/// bitwise those of one process running the m micro-batches one after the other. An optimizer that
/// counts backward passes (DistributedOptimizer) sees one per chunk and micro-batch, v*m, which
/// PipelineRunOptions::optimizer tells it (README "Pipeline parallelism" composes it with ZeRO). Returns
/// the m losses (detached) on the rank that holds the last stage, an empty vector elsewhere. Call
/// on every rank of `comm` with the same schedule. ZB-H1's weight pass runs only the parameters'
/// own branches of the graph, from the gradients its input pass kept where they leave the chain to
/// the input (src/pipeline/split_backward.hpp); a parameter used at several places of a chunk, or
/// stage 0 data that is not floating point, falls back to re-traversing the graph. On NCCL the
/// messages between two compute passes go as one batch (Note [Batched exchanges]); tested
/// on MPI, Gloo and threads both ways (NCCL's path needs a GPU per rank). Sent tensors are
/// released once their sends report completion; c10d's Gloo sends report it only when waited
/// for, so there they live to the end of the call.
std::vector<at::Tensor> run_pipeline(const PipelineSchedule& schedule, Communicator& comm,
                                     const std::vector<PipelineChunk>& chunks,
                                     const std::function<at::Tensor(int microbatch)>& data,
                                     const PipelineRunOptions& options);

}  // namespace shardopt
