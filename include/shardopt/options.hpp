/// \file
/// ZeroOptions: how DistributedOptimizer shards, communicates and steps. Torch-free.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardopt/comm.hpp"
#include "shardopt/parallel_layout.hpp"
#include "shardopt/precision.hpp"
#include "shardopt/sharding.hpp"
#include "shardopt/unit_policy.hpp"

namespace shardopt {

class Units;  ///< shardopt/units.hpp

/// "fp32" | "fp16" | "bf16"; throws Error{InvalidArgument} otherwise.
Precision parse_precision(const std::string& text);

/// How DistributedOptimizer shards, communicates and steps (docs/stages.md has the table of every
/// field). Torch-free; validate() names the first invalid field.
struct ZeroOptions {
  /// What is sharded (shardopt/sharding.hpp); stage_from_int(0..3) converts ZeRO's numbers.
  Stage stage = Stage::Gradients;
  /// Gradients are reduced in buckets of this many bytes (plus alignment); a parameter that does
  /// not fit continues in the next bucket, so bucket buffers never grow with the largest one.
  /// 0: sized from the model, at most 16 MiB and small enough that a higher stage never holds
  /// more than a lower one (Note [Default bucket size], shardopt/detail/plan.hpp).
  int64_t bucket_bytes = 0;
  /// Start each bucket's reduction from the backward hooks as soon as it is complete.
  bool overlap_comm = true;
  /// k: backward() calls per step(). Gradients are summed over them and backward(loss) scales the
  /// loss by 1/k, so opt.backward(loss) and torch's (loss / k).backward() both give the big-batch
  /// gradient (Note [Gradient accumulation convention], src/engine/engine.cpp). Stages 0-1 in
  /// fp32 without offload keep full gradients between micro-steps and communicate once per step.
  /// Stages 2-3, and every stage under fp16/bf16 or offload, copy gradients out of autograd per
  /// bucket and reduce every micro-step into the fp32 (host) gradient shard: k reductions per step
  /// for 1/N gradient memory (shardopt/detail/plan.hpp decides this), unless defer_reduction.
  int grad_accumulation_steps = 1;
  /// Those bucketed gradients summed in their buckets over the micro-steps and reduced once per
  /// step instead (Note [Deferred reduction] in shardopt/detail/plan.hpp; Megatron's way with
  /// pipelines): one reduction per step for the full gradients held until the last micro-step.
  /// No effect where gradients are reduced once per step already. Under pipelines (`grid` with
  /// pp > 1) stages 2-3 defer whatever this says (Note [Pipelines decide two defaults] in
  /// shardopt/detail/plan.hpp).
  bool defer_reduction = false;
  /// Global gradient-norm clipping across all shards; 0 disables it.
  double max_grad_norm = 0.0;
  /// fp16 / bf16: parameters in that dtype, fp32 master weights (see shardopt/precision.hpp).
  Precision precision = Precision::FP32;
  /// Mixed precision: reduce gradients in fp32 (exact sums) or in the compute dtype (half the
  /// bytes on the wire).
  bool reduce_in_fp32 = true;
  /// Compressed gradient communication (DeepSpeed's communication_data_type, FSDP's reduce_dtype):
  /// FP32 keeps the rule above; BF16 or FP16 reduce gradients in that dtype, also when training in
  /// fp32, for half the bytes of every gradient collective. Each rank's gradient is rounded to it
  /// and the sums accumulate in it: with unit roundoff u (bf16 2^-9, fp16 2^-12) the reduced mean
  /// gradient is off by at most about N*u*mean_r|g_r| per element over N ranks (tested against
  /// 2*N*u). fp16 overflows above 65504 (no loss scaling in fp32 training). The reduced gradients,
  /// the update and the optimizer state stay in the master dtype.
  Precision reduce_dtype = Precision::FP32;
  /// Hybrid sharding (FSDP's HYBRID_SHARD, ZeRO++'s hierarchical partitioning): shard within groups
  /// of this many consecutive ranks (a host's ranks, when ranks are placed host by host) and
  /// replicate across the groups. Gradients are reduce-scattered within the group, then only
  /// their shard is all-reduced across groups; parameters are gathered within the group
  /// (make_hybrid_communicator in shardopt/comm.hpp). It must divide the world size; memory per
  /// rank is that of a world of this size. 0: shard over all ranks (flat).
  int shard_group_size = 0;
  /// fp16 only: dynamic loss scaling.
  LossScaleOptions loss_scale;
  /// Update with the fused one-pass CPU kernels (src/kernels: AVX-512/AVX2/scalar, threaded) where
  /// they exist (Adam, AdamW, SGD, LAMB on fp32 host shards); false runs torch's ops (RuleStep).
  /// Both give the same numbers (tested to 1e-6 against torch::optim).
  bool fused_update = true;
  /// None, or CPU: master weights, optimizer state and reduced gradients in host memory.
  Offload offload = Offload::None;
  /// Rank 0's initial parameters are copied to every rank at construction, as DDP does.
  bool broadcast_initial_params = true;
  /// Shard boundaries are aligned to this many bytes (SIMD, NCCL).
  int64_t align_bytes = 64;
  /// Stage 3: the units whose parameters are gathered together (shardopt/units.hpp); the model
  /// calls units->run(i, ...) around each. Parameters in no unit are gathered from zero_grad()
  /// until step(). Unset: automatic units, derived from the parameters' names by `unit_policy`
  /// and gathered on first use (Note [Automatic units] in src/engine/auto_gather.cpp), with no
  /// change to the model.
  std::shared_ptr<Units> units;
  /// Stage 3 without `units`: how units are derived from the parameters' names.
  UnitPolicy unit_policy;
  /// Stage 3: how many units ahead to gather asynchronously (forward and backward); 0 gathers
  /// each unit only when it is needed.
  int prefetch = 1;
  /// Stage 3: whether a unit's parameters are released between their uses within a step (FSDP2's
  /// reshard_after_forward). False keeps each unit gathered from its first use to the step's
  /// update: gathered once per step instead of twice per micro-batch, at the memory of every unit
  /// this rank runs held whole during the step (Note [Parts held through a step] in
  /// src/engine/part_scheduler.cpp). Unset: false under pipelines (`grid` with pp > 1), where a
  /// stage runs the same units for every micro-batch (torchtitan's choice), true otherwise (Note
  /// [Pipelines decide two defaults] in shardopt/detail/plan.hpp).
  std::optional<bool> reshard_between_uses;
  /// Stage 3, automatic units: in forward, when a unit starts, a gathered unit stays gathered if
  /// the order recorded in the last pass (its forward, then its backward) uses it again within
  /// this many unit uses, and is released otherwise (DeepSpeed's stage3_max_reuse_distance,
  /// counted in uses). 0 frees each unit as soon as another starts; larger values trade memory
  /// for fewer gathers. The first pass, or ranks that recorded different orders, keep the two
  /// most recently used units instead (Note [Reuse distance] in src/engine/auto_gather.cpp).
  /// Declared units (`units`) are freed when their run ends.
  int reuse_distance = 2;
  /// Deadline of every collective the optimizer waits on.
  Duration timeout = default_timeout();
  /// Non-finite (NaN/Inf) gradients on any rank skip the step on every rank at every precision
  /// (last_step().skipped). Without loss scaling (fp32, bf16) this many consecutive skipped steps
  /// make step() throw Error{NonFinite}; 0 never throws. Under fp16 loss scaling a skip is the
  /// scaler's normal back-off and is not counted.
  int max_nonfinite_steps = 5;
  /// Model parallelism: the grid this rank belongs to (make_parallel_groups). The optimizer is
  /// given the grid's data-parallel group (`grid.dp`, or a hybrid communicator over it) and holds
  /// one pipeline stage's parameters, slices of the split layers among them. What spans the grid
  /// is the optimizer's (Note [Finalizing gradients over the grid] in
  /// src/engine/finalize_grads.cpp): the gradients of parameters marked with
  /// mark_pipeline_shared (shardopt/pipeline_runner.hpp), which the first and the last stage each
  /// hold, are summed over `grid.embedding` before the update; the clipping norm and the non-finite
  /// check span `grid.tp` and `grid.pp`, counting once every parameter whose split record (Note
  /// [Split records]) carries no split. Default (every group null): data parallelism only; a null
  /// `grid.tp` takes the group of the parameters' split records when one is split over more than
  /// one rank.
  ParallelGroups grid;

  /// Throws Error{InvalidArgument} naming the first invalid field and its valid range.
  void validate() const;
};

}  // namespace shardopt
