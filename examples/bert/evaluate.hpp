// Held-out evaluation: MLM loss/accuracy and NSP loss/accuracy over a whole eval data file,
// sharded across ranks and reduced so that every rank count gives the same numbers bitwise.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "data.hpp"
#include "model.hpp"
#include "pipeline_stages.hpp"
#include "shardopt/comm.hpp"

namespace bert {

struct EvalResult {
  int64_t instances = 0, masked = 0;
  double mlm_loss = 0, mlm_acc = 0;  // mean over every masked position of the set
  double nsp_loss = 0, nsp_acc = 0;  // mean over the instances (0 without the NSP head)
  double nsp_baseline = 0;           // accuracy of always answering the majority NSP label
  double seconds = 0;
  nlohmann::json to_json() const;
  // "[bert] eval at step N: MLM loss ... | NSP ... (majority baseline ...) | ..." for the log.
  std::string line(int64_t step, bool nsp) const;
};

// Note [Evaluation identical at any rank count]: the set is cut into fixed chunks of
// `chunk_rows` instances in file order; chunk c runs on rank c mod N, each chunk's sums go to row
// c of a [chunks, k] table that the ranks all-reduce (every row has one non-zero contributor, so
// the sum is exact), and every rank adds the rows in order. A chunk's forward does not depend on
// N, so neither does the result. Collective: call on all ranks (stage 3 gathers in forward, so
// every rank runs the same number of forwards, repeating chunk 0 where it has none left).
// Under pipelines (`pipeline` given) each chunk goes through the stages
// (PipelineStages::forward_only) and the last stage's sums reach every stage by a broadcast over
// the pipeline group: the same numbers as one process's, up to the rounding of the layers.
EvalResult evaluate(BertForPreTraining& model, const PretrainingData& data,
                    shardopt::Communicator& comm, int64_t chunk_rows,
                    PipelineStages* pipeline = nullptr);

// The first `rows` instances of `data` through the model in eval mode, written by the rank whose
// `path` is not empty as a safetensors file: the inputs (input_ids, token_type_ids,
// attention_mask, masked_positions, masked_labels, nsp_labels; int64), mlm_logits [M, vocab] at
// the M real masked positions in row-major order, and nsp_logits [rows, 2] (with the NSP head).
// Collective: every rank runs the same forward (stage 3 gathers in it).
void dump_logits(BertForPreTraining& model, const PretrainingData& data, int64_t rows,
                 const at::Device& device, const std::string& path);

}  // namespace bert
