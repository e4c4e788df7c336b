// Note [Pipelined BERT] in pipeline_stages.hpp.
#include "pipeline_stages.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <stdexcept>

namespace bert {

std::vector<StageLayers> split_layers(int64_t layers, int stages) {
  if (stages < 1 || layers < stages) {
    throw std::invalid_argument(fmt::format(
        "--pp x --virtual-stages = {} pipeline stages, but the model has {} encoder layers "
        "(num_hidden_layers): each stage needs at least one", stages, layers));
  }
  std::vector<StageLayers> out;
  int64_t next = 0;
  for (int s = 0; s < stages; ++s) {
    const int64_t n = layers / stages + (s < layers % stages ? 1 : 0);
    out.push_back({s, next, next + n, s == 0, s == stages - 1});
    next += n;
  }
  return out;
}

std::vector<StageLayers> chunks_of_rank(const std::vector<StageLayers>& stages, int pp,
                                        int pp_rank) {
  std::vector<StageLayers> out;
  for (size_t s = pp_rank; s < stages.size(); s += pp) out.push_back(stages[s]);
  return out;
}

bool held_by(const std::string& name, const std::vector<StageLayers>& chunks) {
  const auto starts = [&](const char* prefix) { return name.rfind(prefix, 0) == 0; };
  for (const auto& c : chunks) {
    if (c.embeddings && starts("bert.embeddings.")) return true;
    if (c.heads && (starts("bert.pooler.") || starts("cls.") ||
                    name == "bert.embeddings.word_embeddings.weight")) {
      return true;
    }
    if (starts("bert.encoder.layer.")) {
      const int64_t layer = std::stoll(name.substr(std::string("bert.encoder.layer.").size()));
      if (layer >= c.first && layer < c.last) return true;
    }
  }
  return false;
}

std::string describe(const std::vector<StageLayers>& stages) {
  std::vector<std::string> parts;
  for (const auto& s : stages) {
    std::vector<std::string> what;
    if (s.embeddings) what.emplace_back("embeddings");
    what.push_back(s.last - s.first == 1 ? fmt::format("layer {}", s.first)
                                         : fmt::format("layers {}-{}", s.first, s.last - 1));
    if (s.heads) what.emplace_back("heads");
    parts.push_back(fmt::format("stage {}: {}", s.stage, fmt::join(what, " + ")));
  }
  return fmt::format("{}", fmt::join(parts, "; "));
}

PipelineStages::PipelineStages(BertForPreTraining model, const shardopt::ParallelGroups& groups,
                               shardopt::PipelineSchedule schedule, int64_t layers)
    : model_(std::move(model)), pp_(groups.pp), schedule_(std::move(schedule)),
      all_(split_layers(layers, schedule_.stages())),
      stages_(chunks_of_rank(all_, schedule_.ranks, groups.pp_rank)),
      micro_batches_(schedule_.microbatches) {
  // The other stages' parameters are never used here: free them (their optimizer is elsewhere).
  torch::NoGradGuard no_grad;
  for (auto& p : model_->named_parameters()) {
    if (!held_by(p.key(), stages_)) p.value().set_data(torch::empty({0}, p.value().options()));
  }
  for (const auto& stage : stages_) {
    shardopt::PipelineChunk chunk;
    chunk.forward = [this, stage](const at::Tensor& input, int mb) {
      return forward(stage, input, mb);
    };
    for (auto& p : model_->named_parameters()) {
      if (held_by(p.key(), {stage})) chunk.parameters.push_back(p.value());
    }
    chunks_.push_back(std::move(chunk));
  }
}

at::Tensor PipelineStages::forward(const StageLayers& stage, const at::Tensor& input, int mb) {
  const BertInputs& in = inputs_.at(mb);
  at::Tensor x = stage.embeddings ? model_->embed(in.input_ids, in.token_type_ids) : input;
  x = model_->run_layers(x, model_->mask_bias(in.attention_mask, x.scalar_type()), stage.first,
                         stage.last);
  if (!stage.heads) return x;
  x = model_->whole_sequence(x);
  const BertOutputs out = model_->heads(x, model_->pool(x), in);
  {
    torch::NoGradGuard no_grad;
    sums_[kLossSum] += out.loss.item<double>();
    sums_[kMlmLossSum] += out.mlm_loss.item<double>();
    sums_[kNspLossSum] += out.nsp_loss.item<double>();
    sums_[kMlmCorrect] += out.mlm_predictions.eq(out.mlm_labels).sum().item<double>();
    sums_[kMlmCount] += out.mlm_labels.ne(-100).sum().item<double>();
    if (out.nsp_logits.defined()) {
      sums_[kNspCorrect] += out.nsp_logits.argmax(-1).eq(in.nsp_labels).sum().item<double>();
    }
  }
  return out.loss / micro_batches_;
}

std::optional<BertOutputs> PipelineStages::forward_only(const BertInputs& in) {
  torch::NoGradGuard no_grad;
  const int p = pp_->size(), me = pp_->rank();
  const auto device = in.input_ids.device();
  at::Tensor x;
  for (int s = 0; s < static_cast<int>(all_.size()); ++s) {
    if (s % p != me) continue;  // stage s lives on pipeline rank s mod P
    const StageLayers& stage = all_[s];
    if (s > 0) {  // stage s-1's output, from the rank before (P >= 2: never this one)
      const int from = (s - 1) % p;
      at::Tensor header = torch::empty({4}, torch::TensorOptions().dtype(torch::kLong).device(device));
      pp_->recv(header, from);
      const at::Tensor h = header.cpu();
      const int64_t* v = h.data_ptr<int64_t>();
      x = torch::empty({v[1], v[2], v[3]},
                       torch::TensorOptions().dtype(static_cast<at::ScalarType>(v[0])).device(device));
      pp_->recv(x, from);
    }
    if (stage.embeddings) x = model_->embed(in.input_ids, in.token_type_ids);
    x = model_->run_layers(x, model_->mask_bias(in.attention_mask, x.scalar_type()), stage.first,
                           stage.last);
    if (stage.heads) {
      x = model_->whole_sequence(x);
      return model_->heads(x, model_->pool(x), in);
    }
    const int to = (s + 1) % p;
    x = x.contiguous();
    const at::Tensor header =
        torch::tensor({static_cast<int64_t>(x.scalar_type()), x.size(0), x.size(1), x.size(2)},
                      torch::kLong).to(device);
    pp_->send(header, to);
    pp_->send(x, to);
  }
  return std::nullopt;
}

StepSums PipelineStages::run(std::vector<BertInputs> inputs, shardopt::DistributedOptimizer& opt,
                             std::vector<int64_t> activation_shape, at::ScalarType dtype) {
  inputs_ = std::move(inputs);
  sums_ = {};
  shardopt::PipelineRunOptions run;
  run.activation_shape = std::move(activation_shape);
  run.activation_dtype = dtype;
  run.optimizer = &opt;  // the step's passes, ZB-H1's weight pass as one, each chunk's last
  shardopt::run_pipeline(schedule_, *pp_, chunks_,
                         [&](int mb) { return inputs_.at(mb).input_ids; }, run);
  inputs_.clear();
  return sums_;
}

}  // namespace bert
