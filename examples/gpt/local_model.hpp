// This rank's part of the decoder: the stages it holds (one without a pipeline; V with interleaved
// schedules) and one training step's micro-batches through them, pipelined or accumulated.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/parallel_layout.hpp"
#include "shardopt/pipeline.hpp"
#include "shardopt/pipeline_runner.hpp"

namespace gpt {

// Layers [first, last) of stage `stage` of S: layers / S each (GptConfig::check asks that S divides
// them, so every stage costs the same).
struct Span {
  int stage = 0;
  int64_t first = 0, last = 0;
};
std::vector<Span> split_stages(int64_t layers, int stages);
// "stage 0: embeddings + layers 0-1; stage 1: layers 2-3 + head"
std::string describe(const std::vector<Span>& spans);

// One micro-batch on this rank: token ids and next-token targets [B, T] (int64).
struct MicroBatch {
  at::Tensor ids, targets;
};

class LocalModel {
 public:
  // Without `schedule`, the whole model; with one, rank groups.pp_rank's chunks of it (chunk c is
  // stage c*p + pp_rank, shardopt/pipeline.hpp). Weights as Note [Weights by name] draws them.
  LocalModel(const GptConfig& c, const Parallel& par, const shardopt::ParallelGroups& groups,
             std::optional<shardopt::PipelineSchedule> schedule, uint64_t seed,
             at::ScalarType dtype);
  // Every parameter of this rank's chunks under the whole model's names.
  torch::OrderedDict<std::string, at::Tensor> named_parameters() const;
  const std::vector<Span>& spans() const { return all_; }
  bool pipelined() const { return schedule_.has_value(); }
  // One step's M micro-batches: the gradients accumulate into the parameters (opt counts the
  // backward passes: M, or V*M under a pipeline with ZB-H1's weight passes as one each). Returns
  // the sum of the M losses where the last stage is (0 on the other stages).
  double run(std::vector<MicroBatch> micro_batches, shardopt::DistributedOptimizer& opt);

 private:
  at::Tensor chunk_forward(size_t chunk, const at::Tensor& input, int mb);

  shardopt::CommunicatorPtr pp_;
  std::optional<shardopt::PipelineSchedule> schedule_;
  at::ScalarType dtype_;
  int64_t hidden_;
  std::vector<Span> all_;
  std::vector<Stage> chunks_;
  std::vector<shardopt::PipelineChunk> pipeline_chunks_;
  std::vector<MicroBatch> batches_;  // the step's, while run() runs
  double loss_sum_ = 0;
};

}  // namespace gpt
