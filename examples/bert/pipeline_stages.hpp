// Pipeline parallelism for bert_pretrain (--pp P --micro-batches M --schedule S --virtual-stages
// V; Note [Pipelined BERT]): which encoder layers each stage holds, which parameters a rank
// keeps, and the chunk functions shardopt::run_pipeline calls.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "metrics.hpp"
#include "model.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/parallel_layout.hpp"
#include "shardopt/pipeline_runner.hpp"

namespace bert {

// Note [Pipelined BERT]: the S = P*V stages split the encoder layers evenly (the first L % S
// stages one more); stage 0 also holds the embeddings, stage S-1 the pooler and the heads, and
// both hold the tied word embedding (marked with shardopt::mark_pipeline_shared; the optimizer
// sums its two gradients). Rank r's chunk c is stage c*P + r (shardopt/pipeline.hpp). Every stage reads the
// step's M micro-batches (the same rows on the P ranks of a data-parallel rank): stage 0 its
// token ids, the others the attention mask, the last its labels. Between stages travels the
// hidden state [batch, sequence, hidden] in the compute dtype. The last stage returns each
// micro-batch's loss / M, so the M passes add up to the mean a --grad-accum M run computes.
struct StageLayers {
  int stage = 0;
  int64_t first = 0, last = 0;  // encoder layers [first, last)
  bool embeddings = false;      // stage 0
  bool heads = false;           // stage S-1
};

// The stages of `layers` encoder layers over `stages` stages; std::invalid_argument naming both
// when there are fewer layers than stages.
std::vector<StageLayers> split_layers(int64_t layers, int stages);
// Rank pp_rank's chunks, chunk c being stage c*pp + pp_rank.
std::vector<StageLayers> chunks_of_rank(const std::vector<StageLayers>& stages, int pp, int pp_rank);
// Whether BertForPreTraining's parameter `name` lives on one of `chunks`.
bool held_by(const std::string& name, const std::vector<StageLayers>& chunks);
// "stage 0: embeddings + layers 0-1; stage 1: layers 2-3 + heads"
std::string describe(const std::vector<StageLayers>& stages);

// One rank's part of a pipelined step: its chunks over `model` (whose other parameters it frees).
class PipelineStages {
 public:
  // Rank groups.pp_rank's chunks of `schedule` over `model` (whose other parameters it frees).
  PipelineStages(BertForPreTraining model, const shardopt::ParallelGroups& groups,
                 shardopt::PipelineSchedule schedule, int64_t layers);
  const std::vector<StageLayers>& stages() const { return all_; }
  // The names of the parameters this rank's chunks hold (what its optimizer steps).
  bool holds(const std::string& name) const { return held_by(name, stages_); }
  // One step's M micro-batches through the pipeline on this rank: the gradients accumulate into
  // the held parameters (through `opt`, which counts ZB-H1's weight passes as one backward);
  // returns the last stage's sums over them (zeros on the other stages). `activation_shape`:
  // [batch, sequence, hidden]; `dtype`: the compute dtype.
  StepSums run(std::vector<BertInputs> inputs, shardopt::DistributedOptimizer& opt,
               std::vector<int64_t> activation_shape, at::ScalarType dtype);
  // Evaluation: `in` through every stage in order, forward only, no gradients; each stage's
  // output goes to the next stage's rank (its dtype and shape first, so a sequence-parallel
  // shard or another compute dtype needs no agreement beforehand). The last stage's rank returns
  // the heads' outputs, the others nothing. Collective over the pipeline group.
  std::optional<BertOutputs> forward_only(const BertInputs& in);
  // The pipeline group (its last rank holds the last stage).
  const shardopt::CommunicatorPtr& group() const { return pp_; }

 private:
  at::Tensor forward(const StageLayers& stage, const at::Tensor& input, int mb);

  BertForPreTraining model_;
  shardopt::CommunicatorPtr pp_;
  shardopt::PipelineSchedule schedule_;
  std::vector<StageLayers> all_, stages_;  // every stage; this rank's chunks'
  int micro_batches_ = 1;
  std::vector<BertInputs> inputs_;
  std::vector<shardopt::PipelineChunk> chunks_;
  StepSums sums_{};
};

}  // namespace bert
