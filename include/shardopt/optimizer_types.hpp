/// \file
/// The optimizer's value types: parameter groups in, step statistics and the memory report out,
/// and the factory of a torch optimizer over the shard. Light (<ATen/core/Tensor.h> and std only),
/// so the engine's pieces use them without DistributedOptimizer's header (shardopt/optimizer.hpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace shardopt {

/// A parameter and its name (as named_parameters() gives it).
struct NamedParameter {
  std::string name;  ///< the name errors and checkpoints use
  at::Tensor tensor;  ///< the parameter
};

/// A parameter group: its parameters and overrides of the optimizer's rule (torch's param groups).
struct ParamGroup {
  std::vector<NamedParameter> params;  ///< its parameters, in order
  std::optional<double> lr;  ///< overrides the rule's learning rate
  std::optional<double> weight_decay;  ///< overrides the rule's weight decay
};

/// Any torch optimizer over this rank's shard: called once with the shard's flat tensors (each
/// with .grad set before every step). Its state is sharded like the native rules' state.
using ShardOptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> shard)>;

/// What the last step() did.
struct StepStats {
  int64_t step = 0;              ///< optimizer steps taken so far (skipped ones not counted)
  double grad_norm = -1.0;       ///< global L2 norm before clipping; -1 when not computed
  bool clipped = false;  ///< the gradients were clipped (max_grad_norm)
  bool skipped = false;          ///< non-finite gradients on some rank: no update anywhere
  int nonfinite_steps = 0;       ///< consecutive skipped steps so far, this one included
  double loss_scale = 1.0;  ///< fp16: the loss scale after this step
  /// Where step() spent its time, phase by phase (seconds; they add up to step_s but for the
  /// bookkeeping between them):
  double reduce_wait_s = 0.0;    ///< waiting for gradient reductions after backward
  double unscale_s = 0.0;        ///< dividing 16-bit gradients by ranks x loss scale (fp32 ones
                                 ///< are divided inside the non-finite check's pass: 0 then)
  double check_s = 0.0;          ///< the non-finite check (+ fp32 unscale, + the clip's squares)
  double check_backward_s = 0.0;  ///< the check's share done during backward, as reductions
                                  ///< landed (Note [The non-finite check during backward]; not
                                  ///< part of step_s)
  double reduce_wait_backward_s = 0.0;  ///< stages 0-1 in place: backward waiting for its last
                                        ///< reductions before it returns (Note [Gradients are
                                        ///< final when backward returns]; not part of step_s)
  double clip_s = 0.0;           ///< scaling the gradients down to max_grad_norm
  double update_s = 0.0;         ///< the local optimizer update (the fused kernels)
  double write_back_s = 0.0;     ///< master weights cast into the model's dtype where the kernels
                                 ///< did not write them
  double gather_s = 0.0;         ///< all-gathering updated parameters
  double step_s = 0.0;           ///< the whole step() call
  int64_t comm_elements = 0;     ///< gradient and parameter elements this rank sent into
                                 ///< collectives since the last step (one-element flags and norms
                                 ///< of the non-finite check, clipping and LAMB not counted)
  int64_t gather_elements = 0;   ///< the parameter all-gathers' part of comm_elements (stage 3:
                                 ///< every gather of a unit in forward and backward)
  int64_t reduce_elements = 0;   ///< the gradient reductions' part of comm_elements (each bucket
                                 ///< reduced once a step: stage 1's count, whatever the stage)
  int64_t orthogonalized = 0;    ///< Muon: matrices this rank orthogonalised (Newton-Schulz) in
                                 ///< this step; over the ranks, each Muon matrix once
  int64_t exchange_bytes = 0;    ///< Muon: bytes this rank sent to exchange updates with the
                                 ///< matrices' owners (not in comm_elements)
  double orthogonalize_s = 0.0;  ///< Muon: Newton-Schulz time of this rank (part of update_s)
};

/// Bytes this rank holds for the model state, by category (the memory model, docs/stages.md).
struct MemoryReport {
  int64_t param_bytes = 0;            ///< model parameters (full or sharded, compute dtype)
  int64_t grad_bytes = 0;             ///< gradients kept between backward and step
  int64_t optimizer_state_bytes = 0;  ///< optimizer state (+ fp32 master weights when mixed)
  int64_t buffer_bytes = 0;           ///< bounded communication buffers (buckets, gathered units)
  /// Stage 3: the part of param_bytes held whole for good, the persistent parameters (Note
  /// [Persistent parameters] in src/engine/part_store.cpp); param_bytes holds the rest as
  /// shards.
  int64_t persistent_param_bytes = 0;
  /// Host memory this rank's in-memory snapshots take on tmpfs (MemorySnapshots: its two slots
  /// and the two copies it holds for its buddy; Note [Snapshots in memory] in
  /// shardopt/snapshot.hpp): memory that outlives the process, so not in total(); 0 without
  /// snapshots, and again after MemorySnapshots::remove().
  int64_t snapshot_host_bytes = 0;
  /// Everything above but snapshot_host_bytes.
  int64_t total() const { return param_bytes + grad_bytes + optimizer_state_bytes + buffer_bytes; }
};

}  // namespace shardopt
