#include "local_model.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

namespace gpt {

std::vector<Span> split_stages(int64_t layers, int stages) {
  std::vector<Span> out;
  const int64_t each = layers / stages;
  for (int s = 0; s < stages; ++s) out.push_back({s, s * each, (s + 1) * each});
  return out;
}

std::string describe(const std::vector<Span>& spans) {
  std::vector<std::string> parts;
  for (const auto& s : spans) {
    const std::string layers = s.last - s.first == 1
                                   ? fmt::format("layer {}", s.first)
                                   : fmt::format("layers {}-{}", s.first, s.last - 1);
    parts.push_back(fmt::format("stage {}: {}{}{}", s.stage, s.stage == 0 ? "embeddings + " : "",
                                layers,
                                s.stage + 1 == static_cast<int>(spans.size()) ? " + head" : ""));
  }
  return fmt::format("{}", fmt::join(parts, "; "));
}

LocalModel::LocalModel(const GptConfig& c, const Parallel& par,
                       const shardopt::ParallelGroups& groups,
                       std::optional<shardopt::PipelineSchedule> schedule, uint64_t seed,
                       at::ScalarType dtype)
    : pp_(groups.pp),
      schedule_(std::move(schedule)),
      dtype_(dtype),
      hidden_(c.hidden),
      all_(split_stages(c.layers, schedule_ ? schedule_->stages() : 1)) {
  const int p = schedule_ ? schedule_->ranks : 1;
  const int last = static_cast<int>(all_.size()) - 1;
  for (size_t s = groups.pp_rank; s < all_.size(); s += p) {  // only the stages this rank holds
    const Span& span = all_[s];
    Stage stage(c, par, span.first, span.last, span.stage == 0, span.stage == last);
    stage->init_weights(seed);
    stage->to(dtype);
    chunks_.push_back(stage);
  }
  if (!schedule_) return;
  for (size_t i = 0; i < chunks_.size(); ++i) {
    shardopt::PipelineChunk chunk;
    chunk.forward = [this, i](const at::Tensor& input, int mb) {
      return chunk_forward(i, input, mb);
    };
    for (const auto& p : chunks_[i]->parameters()) chunk.parameters.push_back(p);
    pipeline_chunks_.push_back(std::move(chunk));
  }
}

torch::OrderedDict<std::string, at::Tensor> LocalModel::named_parameters() const {
  torch::OrderedDict<std::string, at::Tensor> out;
  for (const auto& stage : chunks_) {
    for (const auto& p : stage->named_parameters()) out.insert(p.key(), p.value());
  }
  return out;
}

// A pipeline chunk: stage 0 embeds the ids, the last stage returns the micro-batch's loss / M so
// that the M backward passes add up to the mean a --grad-accum M run takes.
at::Tensor LocalModel::chunk_forward(size_t chunk, const at::Tensor& input, int mb) {
  Stage& stage = chunks_[chunk];
  at::Tensor x = stage->layers(stage->first_stage() ? stage->embed(input) : input);
  if (!stage->last_stage()) return x;
  const at::Tensor loss = stage->loss(x, batches_.at(mb).targets);
  loss_sum_ += loss.item<double>();
  return loss / static_cast<double>(batches_.size());
}

double LocalModel::run(std::vector<MicroBatch> micro_batches, shardopt::DistributedOptimizer& opt) {
  loss_sum_ = 0;
  if (!schedule_) {
    Stage& whole = chunks_.front();
    for (const auto& mb : micro_batches) {
      const at::Tensor loss = whole->loss(whole->layers(whole->embed(mb.ids)), mb.targets);
      opt.backward(loss);  // scaled by 1/M: the mean over the step's micro-batches
      loss_sum_ += loss.item<double>();
    }
    return loss_sum_;
  }
  batches_ = std::move(micro_batches);
  const auto& ids = batches_.front().ids;
  shardopt::PipelineRunOptions run;
  run.activation_shape = {ids.size(0), ids.size(1), hidden_};
  run.activation_dtype = dtype_;
  run.optimizer = &opt;  // the step's passes, ZB-H1's weight pass as one, each chunk's last
  shardopt::run_pipeline(
      *schedule_, *pp_, pipeline_chunks_, [&](int mb) { return batches_.at(mb).ids; }, run);
  batches_.clear();
  return loss_sum_;
}

}  // namespace gpt
