// BERT for pretraining (Devlin et al. 2019) in libtorch: embeddings, post-LN encoder, pooler,
// masked-LM head and next-sentence head. Parameter names follow Hugging Face's
// BertForPreTraining ("bert.encoder.layer.0.attention.self.query.weight", "cls.predictions.bias").
//
// Note [Tied MLM decoder]: the MLM decoder has no weight of its own. Its logits are
// F::linear(h, bert.embeddings.word_embeddings.weight, cls.predictions.bias), so the tied matrix is
// one parameter, counted once by parameters() and sharded once by the optimizer; only the bias
// (cls.predictions.bias) belongs to the head. Hugging Face's module names the two tensors a second
// time (cls.predictions.decoder.weight, .bias) and its state dict lists both names: tied_aliases()
// says which, and checkpoints and model.pt carry them as aliases. They are not registered here,
// because libtorch's parameters() would then list the matrix twice (a torch optimizer over them
// would step it twice).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <map>
#include <string>
#include <vector>

#include "bert_config.hpp"
#include "data.hpp"
#include "shardopt/tensor_parallel.hpp"
#include "shardopt/units.hpp"

namespace bert {

// Tensors of one batch (int64, on the model's device). masked_labels is -100 where padded.
struct BertInputs {
  at::Tensor input_ids, token_type_ids, attention_mask;  // [B, T]
  at::Tensor masked_positions, masked_labels;            // [B, P]
  at::Tensor nsp_labels;                                 // [B]
};
// Copies a loader batch into tensors on `device` (one copy of the data each).
BertInputs to_inputs(const Batch& batch, const at::Device& device = at::kCPU);

struct BertOutputs {
  at::Tensor loss;        // mlm_loss + nsp_loss (fp32 scalar)
  at::Tensor mlm_loss;    // mean cross-entropy over the masked positions
  at::Tensor nsp_loss;    // mean cross-entropy over the rows (0 without the NSP head)
  at::Tensor mlm_logits;  // [M, vocab] for the M real (non-padding) masked positions, or
                          // [B*T, vocab] with mlm_all_positions; under tensor parallelism this
                          // rank's columns of the padded vocabulary ([.., vocab_padded / t])
  at::Tensor mlm_labels;  // [M], or [B*T] with -100 where nothing is predicted
  at::Tensor mlm_predictions;  // argmax of the whole vocabulary's logits, [M] or [B*T] (int64)
  at::Tensor nsp_logits;  // [B, 2]; undefined without the NSP head
};

// Note [Tensor-parallel BERT] (bert_pretrain --tp T, --sequence-parallel): Megatron's split of
// each encoder layer (query, key, value and the first MLP matrix column-parallel: a/T heads and
// intermediate/T features per rank; the attention output and the second MLP matrix row-parallel),
// the word embeddings vocab-parallel over the vocabulary padded to a multiple of 128*T (the
// padding rows start at zero and never win: their logits are masked out of the softmax, so the
// model computes what the unsplit one does), the tied decoder a column-parallel product with that
// shard and its bias split alike, the loss vocab_parallel_cross_entropy. Everything else is
// replicated on the tensor ranks. Under sequence parallelism the replicated activations between
// the split regions (embeddings' sum, LayerNorms, dropouts, residuals) hold T/t of the sequence;
// the encoder's output is gathered whole before the heads. Dropout inside split regions (the
// attention probabilities; under sequence parallelism every dropout) draws this rank's stream.
// Parameter names stay those of the unsplit model; each split parameter's record (Note [Split
// records] in shardopt/tensor_parallel.hpp) says how it is split.
struct ModelParallel {
  shardopt::tp::TensorParallel tp;  // tp.group null: the unsplit model
  std::shared_ptr<shardopt::tp::RngTracker> rng;
  int size() const { return tp.group ? tp.group->size() : 1; }
};

// One projection of a layer: torch::nn::Linear, or at T > 1 a split layer (the same names).
struct Dense {
  torch::nn::Linear plain{nullptr};
  shardopt::tp::ColumnParallelLinear column{nullptr};
  shardopt::tp::RowParallelLinear row{nullptr};
  at::Tensor operator()(const at::Tensor& x) const;
};

// "auto" -> "sdpa" where this torch has scaled_dot_product_attention (2.1+), else "eager";
// "sdpa" on an older torch is std::invalid_argument naming the version.
std::string resolve_attn_implementation(const std::string& requested);

class BertLayerImpl : public torch::nn::Module {
 public:
  explicit BertLayerImpl(const BertConfig& config, const ModelParallel& mp = {});
  // x: [B, T, H]; mask_bias: [B, 1, 1, T], 0 for tokens and a large negative for padding, or
  // undefined (no padding).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& mask_bias);

 private:
  ModelParallel mp_;
  int64_t heads_, head_dim_;  // heads_: this rank's
  std::string act_;
  bool sdpa_;  // config.attn_implementation resolved (resolve_attn_implementation)
  Dense query_, key_, value_, attn_dense_;
  torch::nn::LayerNorm attn_norm_{nullptr};
  Dense intermediate_, output_;
  torch::nn::LayerNorm output_norm_{nullptr};
  torch::nn::Dropout attn_dropout_{nullptr}, hidden_dropout_{nullptr};
};
TORCH_MODULE(BertLayer);

class BertForPreTrainingImpl : public torch::nn::Module {
 public:
  // declare_units = false builds the model with no Units at all: forward() calls its layers
  // directly, as a model written without shardopt in mind does, and stage 3 derives its units from
  // the parameter names (automatic units, shardopt/unit_policy.hpp; bert_pretrain --units auto).
  // mp: tensor parallelism (Note [Tensor-parallel BERT]); the default, none.
  explicit BertForPreTrainingImpl(const BertConfig& config, bool declare_units = true,
                                  ModelParallel mp = {});
  const BertConfig& config() const { return config_; }
  const ModelParallel& model_parallel() const { return mp_; }
  // Copies this rank's part of each unsplit parameter (an unsplit model's named_parameters(),
  // every name of this model present, unsplit shapes): how a split model starts from the unsplit
  // model's initial values or from pretrained weights.
  void load_unsplit(const torch::OrderedDict<std::string, at::Tensor>& unsplit);
  // This rank's part of the unsplit tensor of parameter `name` (or of a state of its shape, such
  // as Adam's moments); the tensor itself for a replicated parameter. Throws
  // std::invalid_argument naming the parameter when the shape is not the unsplit one.
  at::Tensor slice_of(const std::string& name, const at::Tensor& unsplit) const;
  // The unsplit parameters (padding dropped), on every tensor rank: all-gathers the split ones
  // over the tensor group. Collective over the group; the parameters themselves at T = 1.
  torch::OrderedDict<std::string, at::Tensor> unsplit_parameters();

  // Encoder output [B, T, H] and pooled [CLS] state [B, H] (undefined without the NSP head).
  std::pair<at::Tensor, at::Tensor> encode(const at::Tensor& input_ids,
                                           const at::Tensor& token_type_ids,
                                           const at::Tensor& attention_mask);
  // Logits and losses (losses computed in fp32 whatever the parameters' dtype).
  BertOutputs forward(const BertInputs& inputs);
  // forward()'s pieces, which pipeline stages run apart (examples/bert/pipeline_stages.hpp):
  // encode = embed, run_layers over [0, layers) with mask_bias, (gather,) pool; then heads.
  at::Tensor embed(const at::Tensor& input_ids, const at::Tensor& token_type_ids);
  // The attention's additive mask [B, 1, 1, T]; undefined when no token is padding (CPU).
  at::Tensor mask_bias(const at::Tensor& attention_mask, at::ScalarType dtype) const;
  at::Tensor run_layers(at::Tensor x, const at::Tensor& mask_bias, int64_t first, int64_t last);
  at::Tensor pool(const at::Tensor& sequence);  // undefined without the NSP head
  // The last layer's output as the heads take it: with sequence parallelism each tensor rank holds
  // its share of the sequence, gathered here; otherwise x itself.
  at::Tensor whole_sequence(const at::Tensor& x) const;
  BertOutputs heads(const at::Tensor& sequence, const at::Tensor& pooled, const BertInputs& inputs);

  const at::Tensor& word_embeddings() const { return word_embedding_; }
  // The encoder layers, in order (the natural stage-3 units).
  std::vector<BertLayer> layers() const { return layers_; }
  // The ZeRO stage-3 units: one per encoder layer, then the embeddings, the pooler and the heads.
  // The word embeddings are declared by the embeddings and by the heads (the tied MLM decoder),
  // so stage 3 gathers them at the lookup and again at the decoder. Hand it to the optimizer as
  // ZeroOptions::units. Null when built with declare_units = false.
  const shardopt::UnitsPtr& units() const { return units_; }
  // Recompute every encoder layer's activations in backward instead of keeping them
  // (shardopt/recompute.hpp): less memory, about one more forward per step.
  void set_recompute(bool on);
  // Parameters counted once each (the tied decoder is the word embedding matrix).
  int64_t num_parameters() const;

 private:
  void init_weights();
  at::Tensor decoder_logits(const at::Tensor& t);
  at::Tensor mlm_cross_entropy(const at::Tensor& logits, const at::Tensor& labels);
  at::Tensor mlm_predictions(const at::Tensor& logits);
  // units_->run(unit, fn) with units, else just fn(): the model's code without shardopt's units.
  template <typename Fn>
  auto in_unit(int unit, Fn&& fn) -> decltype(fn()) {
    return units_ ? units_->run(unit, std::forward<Fn>(fn)) : fn();
  }
  BertConfig config_;
  ModelParallel mp_;
  torch::nn::Embedding word_embeddings_{nullptr}, position_embeddings_{nullptr},
      token_type_embeddings_{nullptr};
  shardopt::tp::VocabParallelEmbedding split_word_embeddings_{nullptr};  // at T > 1
  at::Tensor word_embedding_;  // the tied matrix: word_embeddings_'s or split_word_embeddings_'s
  torch::nn::LayerNorm embeddings_norm_{nullptr};
  torch::nn::Dropout embeddings_dropout_{nullptr};
  std::vector<BertLayer> layers_;
  shardopt::UnitsPtr units_;
  int embeddings_unit_ = -1, pooler_unit_ = -1, heads_unit_ = -1;
  bool recompute_ = false;  // without units: every layer through shardopt::recompute
  torch::nn::Linear pooler_{nullptr};
  torch::nn::Linear transform_{nullptr};
  torch::nn::LayerNorm transform_norm_{nullptr};
  at::Tensor decoder_bias_;  // cls.predictions.bias; the decoder weight is word_embeddings_
  torch::nn::Linear seq_relationship_{nullptr};
};
TORCH_MODULE(BertForPreTraining);

// Note [Tied MLM decoder]: Hugging Face's second names of the tied tensors -> the parameter each
// is here ("cls.predictions.decoder.weight" -> "bert.embeddings.word_embeddings.weight", ...).
const std::map<std::string, std::string>& tied_aliases();

}  // namespace bert
