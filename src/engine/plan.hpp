// StagePlan: what the ZeRO stage, the precision and offload mean for the engine, decided once at
// construction. It is the only code that reads the stage number, the precision and offload to
// choose behaviour; every other piece asks the plan. Torch-free (tests/unit/plan_test.cpp).
//
// Note [Stages] (what StagePlan::make turns each stage into)
//   stage 0: Replicated, InPlace gradients (flat buffer, .grad are views), each complete bucket
//            all-reduced in place; every rank updates the whole buffer.
//   stage 1: Sharded: buckets are reduce-scattered into the owned slice; each rank updates its
//            slices; then every bucket is all-gathered in place.
//   stage 2: + Bucketed gradients: a hook copies each fresh .grad into a pooled bucket buffer and
//            frees it; a complete bucket is reduce-scattered and folded into the gradient shard.
//   stage 3: + PerUnit parameters (Note [Stage 3 units] in engine.cpp).
// fp16/bf16 and offload make the master Separate and the gradients Bucketed at every stage.
#pragma once

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
  // The model's parameters: whole on every rank, or sharded and gathered per unit while used.
  enum class Parameters { Whole, PerUnit };
  // The update's target: the model's own storage, or a separate master copy (fp32 and/or host).
  enum class Master { Model, Separate };

  Ownership ownership = Ownership::Sharded;
  Gradients gradients = Gradients::Bucketed;
  Parameters parameters = Parameters::Whole;
  Master master = Master::Model;
  bool master_on_host = false;  // offload: master weights, state and reduced gradients on the host
  bool mixed = false;           // fp16/bf16 compute dtype with fp32 master weights
  bool loss_scaling = false;    // fp16: dynamic loss scaling, overflow skips the step

  // params_on_host: the model's parameters live in host memory (then offload moves nothing).
  // reduce_in_other_dtype: gradients travel in another dtype than the model's (reduce_dtype).
  static constexpr StagePlan make(Stage stage, Precision precision, Offload offload,
                                  bool params_on_host, bool reduce_in_other_dtype = false) {
    StagePlan p;
    p.mixed = precision != Precision::FP32;
    p.loss_scaling = precision == Precision::FP16;
    p.master_on_host = offload == Offload::CPU;
    p.ownership = stage == Stage::Replicated ? Ownership::Replicated : Ownership::Sharded;
    p.parameters = stage == Stage::Parameters ? Parameters::PerUnit : Parameters::Whole;
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
  bool per_unit() const { return parameters == Parameters::PerUnit; }
  bool separate_master() const { return master == Master::Separate; }
  // Bucketed gradients are reduced every micro-step; in-place ones on the last micro-step only.
  bool reduces_every_micro_step() const { return bucketed(); }
  // Sharded whole parameters are all-gathered after the update (per-unit ones on use).
  bool gathers_after_update() const { return sharded() && !per_unit(); }
};

}  // namespace shardopt::detail
