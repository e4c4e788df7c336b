// What checkpointing needs from the optimizer's engine: the flat layout, this rank's owned slices
// of the master parameters and of each optimizer state buffer, step counters and the group rules.
// Implemented by detail::Engine (src/engine/engine.hpp); used by src/checkpoint. Internal.
//
// Owned slice: for every bucket b, elements [rank*S_b, (rank+1)*S_b) of the bucket, in every
// stage, so the on-disk format does not depend on the stage that wrote it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shardopt/comm.hpp"
#include "shardopt/detail/partition.hpp"
#include "shardopt/options.hpp"
#include "shardopt/rules.hpp"

namespace shardopt {
class DistributedOptimizer;

namespace detail {

class ShardAccess {
 public:
  virtual ~ShardAccess() = default;

  virtual const FlatLayout& layout() const = 0;
  virtual const ZeroOptions& zero_options() const = 0;
  // The ranks the layout is sharded over: every rank, or the shard group (hybrid sharding).
  virtual const CommunicatorPtr& comm() const = 0;
  // Hybrid sharding: all ranks, this rank's shard group's index and how many groups (replicas)
  // there are; flat sharding: comm(), 0 and 1.
  virtual const CommunicatorPtr& world_comm() const = 0;
  virtual int replica() const = 0;
  virtual int replicas() const = 0;
  // Parameter i of the layout (layout().slots[i]): its named_parameters() name and shape.
  virtual const std::string& param_name(int index) const = 0;
  virtual std::vector<int64_t> param_shape(int index) const = 0;
  // The model's tensor itself (its split record: Note [Split records], tensor_parallel.hpp).
  virtual const at::Tensor& param_tensor(int index) const = 0;
  // Its position in the parameter lists the optimizer was given (manifests list that order).
  virtual int64_t param_order(int index) const = 0;
  // dtype of the master parameters and of the optimizer state.
  virtual at::ScalarType master_dtype() const = 0;
  // True when a ShardOptimizerFactory built the update (its state is the torch optimizer's).
  virtual bool has_factory_optimizer() const = 0;
  // Number of state buffers the native rule keeps (see the rule's state names).
  virtual int state_buffer_count() const = 0;

  // Writable views of this rank's owned slice of bucket `bucket` (S_b elements, contiguous).
  virtual at::Tensor owned_param_slice(int bucket) = 0;
  virtual at::Tensor owned_state_slice(int state, int bucket) = 0;

  // Optimizer steps taken (skipped ones not counted); the next step is number step_count() + 1.
  virtual int64_t step_count() const = 0;
  virtual void set_step_count(int64_t steps) = 0;

  // The rule of each parameter group as the torch param group holds it now (LR schedules write
  // there).
  virtual int group_count() const = 0;
  virtual Rule group_rule(int group) const = 0;
  virtual void set_group_rule(int group, const Rule& rule) = 0;

  // fp16's loss scaler (none otherwise).
  virtual std::optional<LossScaler::State> loss_scaler_state() const = 0;
  virtual void set_loss_scaler_state(const LossScaler::State& state) = 0;

  // Collective. After owned slices were overwritten: makes every rank's full parameters (and
  // stage 0's full state) agree again and clears gradients.
  virtual void after_load() = 0;

  // What in-memory snapshots of this state take on tmpfs (MemorySnapshots), for memory().
  virtual void set_snapshot_host_bytes(int64_t bytes) = 0;
  virtual int64_t snapshot_host_bytes() const = 0;
};

ShardAccess& shard_access(DistributedOptimizer& optimizer);

}  // namespace detail
}  // namespace shardopt
