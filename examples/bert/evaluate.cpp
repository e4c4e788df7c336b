// Sharded held-out evaluation (see evaluate.hpp).
#include "evaluate.hpp"

#include <torch/torch.h>

#include <chrono>
#include <fmt/format.h>

#include "pretrained.hpp"

namespace bert {

nlohmann::json EvalResult::to_json() const {
  return {{"instances", instances}, {"masked", masked},       {"mlm_loss", mlm_loss},
          {"mlm_acc", mlm_acc},     {"nsp_loss", nsp_loss},   {"nsp_acc", nsp_acc},
          {"nsp_baseline", nsp_baseline}, {"seconds", seconds}};
}

std::string EvalResult::line(int64_t step, bool nsp) const {
  std::string s = fmt::format("[bert] eval at step {}: MLM loss {:.3f} acc {:.3f}", step, mlm_loss,
                              mlm_acc);
  if (nsp) {
    s += fmt::format(" | NSP loss {:.3f} acc {:.3f} (majority baseline {:.3f})", nsp_loss, nsp_acc,
                     nsp_baseline);
  }
  return s + fmt::format(" | {} held-out instances, {:.1f} s", instances, seconds);
}

EvalResult evaluate(BertForPreTraining& model, const PretrainingData& data,
                    shardopt::Communicator& comm, int64_t chunk_rows, PipelineStages* pipeline) {
  const auto t0 = std::chrono::steady_clock::now();
  const int rank = comm.rank(), world = comm.size();
  const int64_t n = data.size();
  const int64_t chunks = (n + chunk_rows - 1) / chunk_rows;
  const int64_t rounds = (chunks + world - 1) / world;
  enum { kMlmLoss, kMlmCorrect, kMasked, kNspLoss, kNspCorrect, kRows, kFields };
  auto table = torch::zeros({std::max<int64_t>(chunks, 1), kFields}, torch::kDouble);
  auto t = table.accessor<double, 2>();
  const bool was_training = model->is_training();
  model->eval();
  {
    torch::NoGradGuard no_grad;
    for (int64_t round = 0; round < rounds; ++round) {
      const int64_t c = round * world + rank;
      const bool real = c < chunks;
      const int64_t first = real ? c * chunk_rows : 0;
      std::vector<int64_t> rows;
      for (int64_t i = first; i < std::min(n, first + chunk_rows); ++i) rows.push_back(i);
      const BertInputs inputs = to_inputs(data.batch(rows), model->word_embeddings().device());
      const std::optional<BertOutputs> result =
          pipeline ? pipeline->forward_only(inputs) : std::optional<BertOutputs>(model->forward(inputs));
      if (!real || !result) continue;  // a stand-in forward keeps stage 3's gathers in step
      const BertOutputs& out = *result;
      const auto masked = out.mlm_labels.ne(-100);
      const double count = masked.sum().item<double>();
      t[c][kMlmLoss] = out.mlm_loss.item<double>() * count;
      t[c][kMlmCorrect] = out.mlm_predictions.eq(out.mlm_labels).logical_and(masked)
                              .sum().item<double>();
      t[c][kMasked] = count;
      t[c][kRows] = static_cast<double>(rows.size());
      if (out.nsp_logits.defined()) {
        t[c][kNspLoss] = out.nsp_loss.item<double>() * static_cast<double>(rows.size());
        t[c][kNspCorrect] = out.nsp_logits.argmax(-1).eq(inputs.nsp_labels).sum().item<double>();
      }
    }
  }
  if (was_training) model->train();
  comm.all_reduce(table, shardopt::ReduceOp::Sum);
  // Pipelines: only the last stage has sums; its table, the same on its tensor ranks, to all.
  if (pipeline) pipeline->group()->broadcast(table, pipeline->group()->size() - 1);
  double sums[kFields] = {};
  for (int64_t c = 0; c < chunks; ++c) {
    for (int f = 0; f < kFields; ++f) sums[f] += t[c][f];
  }
  EvalResult r;
  r.instances = static_cast<int64_t>(sums[kRows]);
  r.masked = static_cast<int64_t>(sums[kMasked]);
  if (sums[kMasked] > 0) r.mlm_loss = sums[kMlmLoss] / sums[kMasked], r.mlm_acc = sums[kMlmCorrect] / sums[kMasked];
  if (sums[kRows] > 0) r.nsp_loss = sums[kNspLoss] / sums[kRows], r.nsp_acc = sums[kNspCorrect] / sums[kRows];
  const double random_next = static_cast<double>(data.random_next_count());
  if (n > 0) r.nsp_baseline = std::max(random_next, static_cast<double>(n) - random_next) / n;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

void dump_logits(BertForPreTraining& model, const PretrainingData& data, int64_t rows,
                 const at::Device& device, const std::string& path) {
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < std::min(rows, data.size()); ++i) ids.push_back(i);
  const bool was_training = model->is_training();
  model->eval();
  torch::NoGradGuard no_grad;
  const BertInputs in = to_inputs(data.batch(ids), device);
  const BertOutputs out = model->forward(in);
  if (was_training) model->train();
  if (path.empty()) return;
  std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"input_ids", in.input_ids},
      {"token_type_ids", in.token_type_ids},
      {"attention_mask", in.attention_mask},
      {"masked_positions", in.masked_positions},
      {"masked_labels", in.masked_labels},
      {"nsp_labels", in.nsp_labels},
      {"mlm_labels", out.mlm_labels},  // [M], or [rows * T] with -100 (mlm_all_positions)
      {"mlm_logits", out.mlm_logits.to(torch::kFloat)}};
  if (out.nsp_logits.defined()) tensors.emplace_back("nsp_logits", out.nsp_logits.to(torch::kFloat));
  write_safetensors(path, tensors);
}

}  // namespace bert
