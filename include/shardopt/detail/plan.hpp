// StagePlan: what the ZeRO stage, the precision and offload mean for the engine, decided once at
// construction, and where each kind of buffer lives (Placement). It is the only code that reads
// the stage number, the precision and offload to choose behaviour; every other piece asks the
// plan. Torch-free: the memory estimator (shardopt/estimate.hpp) models the stages with it too
// (tests/unit/plan_test.cpp; src/engine/placement.hpp turns a Placement into tensor options).
//
// Note [Stages] (what StagePlan::make turns each stage into)
//   stage 0: Replicated, InPlace gradients (flat buffer, .grad are views), each complete bucket
//            all-reduced in place; every rank updates the whole buffer.
//   stage 1: Sharded: buckets are reduce-scattered into the owned slice; each rank updates its
//            slices; then every bucket is all-gathered in place.
//   stage 2: + Bucketed gradients: a hook copies each fresh .grad into a pooled bucket buffer and
//            frees it; a complete bucket is reduce-scattered and folded into the gradient shard.
//   stage 3: + PerPart parameters (Note [Stage 3 units] in src/engine/engine.cpp).
// fp16/bf16 make the master Separate and the gradients Bucketed at every stage; so does offload
// (the master stays the model's storage when the parameters already live on the host), and a
// reduce_dtype buckets the gradients.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>

#include "shardopt/precision.hpp"
#include "shardopt/sharding.hpp"

namespace shardopt::detail {

struct StagePlan {
  // Who updates what: every rank the whole flat buffer, or each rank its owned slices.
  enum class Ownership { Replicated, Sharded };
  // Where gradients go. InPlace: autograd accumulates into a flat buffer that the parameters'
  // .grad are views of, reduced once per step. Bucketed: each gradient is copied into a pooled
  // bucket buffer and freed; buckets are reduced every micro-step into the reduced-gradient shard.
  enum class Gradients { InPlace, Bucketed };
  // The model's parameters: whole on every rank, or sharded and gathered per part (Note [Part
  // lifecycle] in src/engine/part_store.cpp) while used.
  enum class Parameters { Whole, PerPart };
  // The update's target: the model's own storage, or a separate master copy (fp32 and/or host).
  enum class Master { Model, Separate };

  Ownership ownership = Ownership::Sharded;
  Gradients gradients = Gradients::Bucketed;
  Parameters parameters = Parameters::Whole;
  Master master = Master::Model;
  bool master_on_host = false;  // offload: master weights, state and reduced gradients on the host
  bool mixed = false;           // fp16/bf16 compute dtype with fp32 master weights
  bool loss_scaling = false;    // fp16: dynamic loss scaling, overflow skips the step
  // Bucketed gradients summed in their buckets over the micro-steps and reduced on the last one
  // (Note [Deferred reduction]); in-place gradients are reduced so anyway.
  bool defer_reduction = false;

  // params_on_host: the model's parameters live in host memory (then offload moves nothing).
  // reduce_in_other_dtype: gradients travel in another dtype than the model's (reduce_dtype).
  static constexpr StagePlan make(Stage stage, Precision precision, Offload offload,
                                  bool params_on_host, bool reduce_in_other_dtype = false) {
    StagePlan p;
    p.mixed = precision != Precision::FP32;
    p.loss_scaling = precision == Precision::FP16;
    p.master_on_host = offload == Offload::CPU;
    p.ownership = stage == Stage::Replicated ? Ownership::Replicated : Ownership::Sharded;
    p.parameters = stage == Stage::Parameters ? Parameters::PerPart : Parameters::Whole;
    p.master = p.mixed || (p.master_on_host && !params_on_host) ? Master::Separate : Master::Model;
    // A separate fp32 or host master needs its gradients out of autograd (cast, moved) anyway,
    // and so does a reduction in another dtype (a cast into the bucket).
    p.gradients = stage >= Stage::Gradients || p.mixed || p.master_on_host || reduce_in_other_dtype
                      ? Gradients::Bucketed
                      : Gradients::InPlace;
    return p;
  }

  bool sharded() const { return ownership == Ownership::Sharded; }
  bool bucketed() const { return gradients == Gradients::Bucketed; }
  bool per_part() const { return parameters == Parameters::PerPart; }
  bool separate_master() const { return master == Master::Separate; }
  // Bucketed gradients are reduced every micro-step unless deferred; in-place ones on the last
  // micro-step only.
  bool reduces_every_micro_step() const { return bucketed() && !defer_reduction; }
  // Deferred bucketed gradients: each bucket keeps its buffer over the step's micro-steps.
  bool accumulates_in_buckets() const { return bucketed() && defer_reduction; }
  // Sharded whole parameters are all-gathered after the update (per-part ones on use).
  bool gathers_after_update() const { return sharded() && !per_part(); }
};

// An element type, relative to the parameters as the optimizer is given them.
enum class Dtype { AsGiven, F32, F16, BF16 };
constexpr Dtype dtype_of(Precision precision) {
  return precision == Precision::BF16 ? Dtype::BF16
         : precision == Precision::FP16 ? Dtype::F16
                                        : Dtype::F32;
}
// Bytes per element; `given`: the bytes of the parameters' own dtype.
constexpr int bytes_of(Dtype dtype, int given) {
  return dtype == Dtype::AsGiven ? given : dtype == Dtype::F32 ? 4 : 2;
}

// Note [Placement] (Note [Mixed precision] in shardopt/precision.hpp): the model's parameters in
// the compute dtype on their device; master weights, optimizer state and reduced gradients in fp32
// (mixed) on the host (offload) or next to the parameters; gradients travel (bucket buffers, or
// InPlace the flat gradient buffer) in reduce_dtype when set, else in fp32 (mixed with
// reduce_in_fp32) or the model's dtype.
struct Placement {
  Dtype model = Dtype::AsGiven;   // the model's parameters
  Dtype master = Dtype::AsGiven;  // master weights, optimizer state, reduced gradients
  Dtype reduce = Dtype::AsGiven;  // gradients on the wire
  bool master_on_host = false;    // master, state and reduced gradients in host memory
  bool pinned = false;            // ... pinned, for copies to and from the device

  static constexpr Placement make(const StagePlan& plan, Precision precision,
                                  Precision reduce_dtype, bool reduce_in_fp32,
                                  bool params_on_host) {
    Placement p;
    p.model = plan.mixed ? dtype_of(precision) : Dtype::AsGiven;
    p.master = plan.mixed ? Dtype::F32 : Dtype::AsGiven;
    p.reduce = reduce_dtype != Precision::FP32 ? dtype_of(reduce_dtype)
               : plan.mixed && reduce_in_fp32  ? Dtype::F32
                                               : p.model;
    p.master_on_host = plan.master_on_host;
    p.pinned = plan.master_on_host && !params_on_host;
    return p;
  }
};

// Note [Bucket pool bound]
// Where the plan buckets gradients, they pass through a pool of bucket buffers of one bucket each
// (the largest bucket's padded elements, in the reduce dtype). The pool holds at most
// kBucketPoolBuffers of them: a bucket is launched as soon as its last piece is in (from the
// gradient hooks in backward, and in step() for gradients set by hand), and a bucket that needs a
// buffer while the pool is full waits for the oldest reduction in flight and takes its buffer.
// The one way past it: a bucket started but held open by a parameter whose gradient comes late or
// never in this pass (unused in the forward) keeps its buffer until it completes or the pass
// ends, so each such bucket can add one buffer (never more than the buckets there are). The bound
// grows neither with N nor with the model. The reducer (src/engine/gradient_reducer.cpp), the
// estimator (shardopt/estimate.hpp), bench/memory_scaling and the tests read this constant; the
// documents quote this Note.
inline constexpr int kBucketPoolBuffers = 2;

// Note [Deferred reduction]
// Bucketed gradients (stages 2-3, mixed precision, offload) are reduce-scattered every micro-step:
// k reductions per step for 1/N of the gradients held. ZeroOptions::defer_reduction trades that the
// other way, as Megatron and torchtitan do with pipelines: each bucket keeps its buffer from its
// first gradient of the step to the last micro-step, gradients are added into it, and it is
// reduced once. Each bucket has a buffer of its own size, kept between steps: Ψ elements in the
// reduce dtype (what stage 1 holds in fp32) instead of the pool's two buckets; the reduced
// gradients and everything else keep their stage.
// Interleaved pipelines gain most: a pass covers one chunk, and per-micro-step reduction sends
// the other chunk's buckets as zeros (v times the reductions of a plain schedule).

// Note [Pipelines decide two defaults]
// Under a pipeline of more than one rank (ZeroOptions::grid.pp), each stage runs the same
// parameters for every micro-batch of the step, so two defaults change, here and nowhere else
// (the engine and the estimator both ask these functions):
//   - bucketed gradients (stages 2-3) defer their reduction whatever defer_reduction says: each
//     chunk's buckets once its last backward pass is over (Note [Pipeline handshake] in
//     src/pipeline/runner.cpp), at the memory of Note [Deferred reduction] (Megatron's way);
//   - stage 3 holds each unit gathered from its first use to the step's update unless
//     reshard_between_uses is set (torchtitan's choice): every unit of the stage whole.
constexpr bool defers_reduction(bool asked, int pipeline_ranks) {
  return asked || pipeline_ranks > 1;
}
constexpr bool holds_parts_through_step(std::optional<bool> reshard_between_uses,
                                        int pipeline_ranks) {
  return !reshard_between_uses.value_or(pipeline_ranks <= 1);
}

// Note [Default bucket size]
// Stage 2 frees (N-1)/N of the gradients but holds the bucket pool (two buffers of one bucket each:
// Note [Bucket pool bound]) that stage 1 does without (in fp32 it reduces in place); with fixed 16
// MiB buckets a small model at N = 2 held more at stage 2 than at stage 1 (DeepSpeed's "ZeRO-2 uses
// more memory than ZeRO-1"). So ZeroOptions::bucket_bytes = 0 (the default) sizes buckets from the
// model: a bucket holds at most kMaxDefaultBucketBytes and at most a quarter of the gradient
// elements a rank frees, Ψ·(N-1)/(4N), so the two buffers are at most half of what stage 2 saves.
// Stage 3 saves as much again on the parameters, which pays for two gathered units of one bucket
// each (the estimator's default), so a higher stage never holds more model state than a lower one.
// The size depends on Ψ and N only, not on the stage: every stage cuts the same buckets. One rank
// frees nothing and keeps the maximum. An explicit bucket_bytes is used as given. The engine
// (src/engine/engine.cpp), the estimator (shardopt/estimate.hpp) and bench/memory_scaling all call
// bucket_numel.
inline constexpr int64_t kMaxDefaultBucketBytes = int64_t{16} << 20;

// Elements per bucket for `bucket_bytes` (0: the default above) over `params` elements of
// `elem_bytes` each on `world` ranks; at least 1 (make_layout rounds it to whole shards).
constexpr int64_t bucket_numel(int64_t bucket_bytes, int64_t params, int world,
                               int64_t elem_bytes) {
  const int64_t elem = std::max<int64_t>(1, elem_bytes);
  if (bucket_bytes > 0) return std::max<int64_t>(1, bucket_bytes / elem);
  const int64_t most = kMaxDefaultBucketBytes / elem;
  if (world <= 1) return most;
  const int64_t freed = params / world * (world - 1);
  return std::max<int64_t>(1, std::min(most, freed / 4));
}

}  // namespace shardopt::detail
