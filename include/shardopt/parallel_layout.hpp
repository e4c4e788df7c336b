/// \file
/// ParallelLayout: the rank grid of model parallelism (tensor x data x pipeline), as Megatron lays
/// it out: tensor-parallel ranks innermost (consecutive ranks, one host when ranks are placed host
/// by host: the tensor group talks the most), then data parallel, then pipeline stages:
///   world rank = tp_rank + tp * (dp_rank + dp * pp_rank)
/// make_parallel_groups cuts a world communicator into the three groups with Communicator::split;
/// DistributedOptimizer is then given `dp` and shards the tensor-split parameters (and one
/// pipeline stage's) over it.
#pragma once

#include <string>

#include "shardopt/comm.hpp"

namespace shardopt {

/// The rank grid of model parallelism: tensor ranks innermost, then data parallel, then pipeline
/// stages (Megatron's order).
struct ParallelLayout {
  int tp = 1;  ///< tensor-parallel ranks per group (shardopt/tensor_parallel.hpp)
  int pp = 1;  ///< pipeline stages
  int dp = 0;  ///< data-parallel replicas; 0: world size / (tp * pp)

  /// "tp=2 x dp=2 x pp=1"
  std::string to_string() const;
};

/// This rank's communicators of the grid, as make_parallel_groups() cuts them.
struct ParallelGroups {
  ParallelLayout layout;  ///< with dp resolved
  ///@{
  /// The world, and this rank's tensor-, data- and pipeline-parallel groups.
  CommunicatorPtr world, tp, dp, pp;
  ///@}
  /// Pipelines (pp > 1): the first and the last stage's data-parallel ranks of this tensor rank,
  /// first stage first (2d ranks), where the tied word embedding's two copies live
  /// (the tied parameters' sum: mark_pipeline_shared; Megatron's embedding group). Null on the other stages
  /// and when pp = 1.
  CommunicatorPtr embedding;
  ///@{
  /// This rank's coordinates in the grid: its rank in tp, dp and pp.
  int tp_rank = 0, dp_rank = 0, pp_rank = 0;
  ///@}

  bool first_stage() const { return pp_rank == 0; }  ///< on the first pipeline stage
  bool last_stage() const { return pp_rank == layout.pp - 1; }  ///< on the last pipeline stage
};

/// Collective over `world`. Throws Error{InvalidArgument} naming the sizes when tp, pp or dp is
/// below 1 or tp * dp * pp differs from the world's size.
ParallelGroups make_parallel_groups(const CommunicatorPtr& world, ParallelLayout layout);

}  // namespace shardopt
