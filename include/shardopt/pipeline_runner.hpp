// Runs a compiled pipeline schedule (shardopt/pipeline.hpp) on this rank: its chunks' forward
// functions, autograd for the backward passes, the communicator's send/recv between stages, and
// gradient accumulation over the micro-batches into the parameters' .grad.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "shardopt/comm.hpp"
#include "shardopt/pipeline.hpp"

namespace shardopt {

// One chunk (model stage) on this rank: a function of tensors, e.g. a lambda over a
// torch::nn::Module's forward. Its parameters are needed only by split backwards (ZB-H1).
struct PipelineChunk {
  // forward(input, microbatch): input is the micro-batch's data on stage 0 and the previous
  // stage's activation (a leaf that requires grad) elsewhere. The last stage returns the
  // micro-batch's loss, a scalar whose backward is what a single process would call.
  std::function<at::Tensor(const at::Tensor& input, int microbatch)> forward;
  std::vector<at::Tensor> parameters;
};

struct PipelineRunOptions {
  // Shape and dtype of every activation between stages (and of its gradient): receives are
  // posted into tensors of this shape, as Megatron's tensor_shape.
  std::vector<int64_t> activation_shape;
  at::ScalarType activation_dtype = at::kFloat;
};

// Runs rank comm.rank()'s list of `schedule` (its ranks must equal comm.size()). `chunks` holds
// this rank's v chunks in chunk order; `data(microbatch)` gives stage 0's inputs (called on the
// rank that holds stage 0 only). Gradients accumulate into the parameters' .grad as the
// micro-batches' backward passes run, in micro-batch order on every stage, so fp32 results are
// bitwise those of one process running the m micro-batches one after the other. Returns the m
// losses (detached) on the rank that holds the last stage, an empty vector elsewhere. Call on
// every rank of `comm` with the same schedule. ZB-H1's weight pass re-traverses the chunk's graph
// for its parameters (torch::autograd::backward with inputs): correct, not yet faster. Tested on
// MPI and Gloo; on NCCL a lone send and a lone receive queue on one stream, so two ranks sending
// to each other at once would wait on each other there: pairing them in one batch_isend_irecv
// (Megatron's send_forward_recv_backward) is still to do. Sent tensors are released once their
// sends report completion; c10d's Gloo sends report it only when waited for, so there they live
// to the end of the call.
std::vector<at::Tensor> run_pipeline(const PipelineSchedule& schedule, Communicator& comm,
                                     const std::vector<PipelineChunk>& chunks,
                                     const std::function<at::Tensor(int microbatch)>& data,
                                     const PipelineRunOptions& options);

}  // namespace shardopt
