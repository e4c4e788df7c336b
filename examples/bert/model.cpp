// BERT encoder, pooler, MLM and NSP heads (see model.hpp for names and the tied decoder).
#include "model.hpp"

#include <ATen/record_function.h>
#include <torch/torch.h>

#include <cmath>
#include <stdexcept>

namespace bert {

namespace F = torch::nn::functional;
using torch::nn::Module;

BertInputs to_inputs(const Batch& b, const at::Device& device) {
  auto make = [&](const std::vector<int64_t>& v, std::vector<int64_t> shape) {
    const auto view = torch::from_blob(const_cast<int64_t*>(v.data()), shape, torch::kLong);
    return device.is_cpu() ? view.clone() : view.to(device);
  };
  BertInputs in;
  in.input_ids = make(b.input_ids, {b.rows, b.seq_length});
  in.token_type_ids = make(b.token_type_ids, {b.rows, b.seq_length});
  in.attention_mask = make(b.attention_mask, {b.rows, b.seq_length});
  in.masked_positions = make(b.masked_positions, {b.rows, b.max_predictions});
  in.masked_labels = make(b.masked_labels, {b.rows, b.max_predictions});
  in.nsp_labels = make(b.nsp_labels, {b.rows});
  return in;
}

// Note [Step phases]: named ranges for the profiler (bench/profile_bert_step.py attributes each
// forward op, and through its sequence number the backward node it creates, to the innermost
// range); one branch on a thread-local flag when no profiler runs. The names are the peer's too.
#define BERT_PHASE(name) RECORD_USER_SCOPE("phase::" name)

// Through at::linear (PyTorch's F.linear): addmm with the bias for inputs of any rank. The C++
// frontend's Linear / F::linear computes matmul and then adds the bias in a second pass over the
// output (and a reduction for its gradient) whenever the input has more than two dimensions.
static at::Tensor linear(const torch::nn::Linear& m, const at::Tensor& x) {
  return torch::linear(x, m->weight, m->bias);
}

// hidden_act: BERT's gelu is the exact (erf) one; gelu_new / gelu_pytorch_tanh the tanh
// approximation (Hugging Face's names).
static at::Tensor activation(const at::Tensor& x, const std::string& name) {
  if (name == "gelu") return torch::gelu(x);
  if (name == "relu") return torch::relu(x);
  return torch::gelu(x, "tanh");  // validate() admits nothing else
}

const std::map<std::string, std::string>& tied_aliases() {
  static const std::map<std::string, std::string> aliases = {
      {"cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"},
      {"cls.predictions.decoder.bias", "cls.predictions.bias"}};
  return aliases;
}

// ---- encoder layer ----------------------------------------------------------------------------

BertLayerImpl::BertLayerImpl(const BertConfig& c)
    : heads_(c.num_heads), head_dim_(c.hidden_size / c.num_heads), act_(c.hidden_act) {
  const int64_t h = c.hidden_size;
  auto ln = [&] { return torch::nn::LayerNorm(torch::nn::LayerNormOptions({h}).eps(c.layer_norm_eps)); };
  // Plain modules only to reproduce the reference parameter names.
  auto attention = register_module("attention", std::make_shared<Module>());
  auto self = attention->register_module("self", std::make_shared<Module>());
  query_ = self->register_module("query", torch::nn::Linear(h, h));
  key_ = self->register_module("key", torch::nn::Linear(h, h));
  value_ = self->register_module("value", torch::nn::Linear(h, h));
  auto attention_output = attention->register_module("output", std::make_shared<Module>());
  attn_dense_ = attention_output->register_module("dense", torch::nn::Linear(h, h));
  attn_norm_ = attention_output->register_module("LayerNorm", ln());
  auto intermediate = register_module("intermediate", std::make_shared<Module>());
  intermediate_ = intermediate->register_module("dense", torch::nn::Linear(h, c.intermediate_size));
  auto output = register_module("output", std::make_shared<Module>());
  output_ = output->register_module("dense", torch::nn::Linear(c.intermediate_size, h));
  output_norm_ = output->register_module("LayerNorm", ln());
  attn_dropout_ = register_module("attention_dropout", torch::nn::Dropout(c.attention_dropout));
  hidden_dropout_ = register_module("hidden_dropout", torch::nn::Dropout(c.hidden_dropout));
}

at::Tensor BertLayerImpl::forward(const at::Tensor& x, const at::Tensor& mask_bias) {
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2);
  auto split = [&](const at::Tensor& t) {  // [B, T, H] -> [B, heads, T, head_dim]
    return t.view({B, T, heads_, head_dim_}).transpose(1, 2);
  };
  at::Tensor q, k, v, scores, probs, context, attended, out;
  {
    BERT_PHASE("qkv");
    q = split(linear(query_, x)), k = split(linear(key_, x)), v = split(linear(value_, x));
  }
  {
    BERT_PHASE("scores");
    scores = torch::matmul(q, k.transpose(-1, -2)) * (1.0 / std::sqrt(double(head_dim_)));
    if (mask_bias.defined()) scores = scores + mask_bias;
  }
  {
    BERT_PHASE("softmax");
    probs = attn_dropout_(torch::softmax(scores, -1));
  }
  {
    BERT_PHASE("context");
    context = torch::matmul(probs, v).transpose(1, 2).reshape({B, T, H});
  }
  {
    BERT_PHASE("attn_out");
    attended = hidden_dropout_(linear(attn_dense_, context)) + x;
  }
  {
    BERT_PHASE("layernorm");
    attended = attn_norm_(attended);
  }
  {
    BERT_PHASE("ffn");
    const auto inner = activation(linear(intermediate_, attended), act_);
    out = hidden_dropout_(linear(output_, inner)) + attended;
  }
  BERT_PHASE("layernorm");
  return output_norm_(out);
}

// ---- the whole model --------------------------------------------------------------------------

BertForPreTrainingImpl::BertForPreTrainingImpl(const BertConfig& c, bool declare_units)
    : config_(c), units_(declare_units ? std::make_shared<shardopt::Units>() : nullptr) {
  c.validate();
  const int64_t h = c.hidden_size;
  auto ln = [&] { return torch::nn::LayerNorm(torch::nn::LayerNormOptions({h}).eps(c.layer_norm_eps)); };
  auto bert = register_module("bert", std::make_shared<Module>());
  auto embeddings = bert->register_module("embeddings", std::make_shared<Module>());
  word_embeddings_ = embeddings->register_module("word_embeddings", torch::nn::Embedding(c.vocab_size, h));
  position_embeddings_ = embeddings->register_module(
      "position_embeddings", torch::nn::Embedding(c.max_position_embeddings, h));
  token_type_embeddings_ = embeddings->register_module(
      "token_type_embeddings", torch::nn::Embedding(c.type_vocab_size, h));
  embeddings_norm_ = embeddings->register_module("LayerNorm", ln());
  embeddings_dropout_ = embeddings->register_module("dropout", torch::nn::Dropout(c.hidden_dropout));

  auto encoder = bert->register_module("encoder", std::make_shared<Module>());
  auto list = encoder->register_module("layer", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_layers; ++i) {
    layers_.emplace_back(c);
    list->push_back(layers_.back());
    if (units_) units_->add_module("layer" + std::to_string(i), layers_.back());
  }
  if (c.nsp) {
    auto pooler = bert->register_module("pooler", std::make_shared<Module>());
    pooler_ = pooler->register_module("dense", torch::nn::Linear(h, h));
  }

  auto cls = register_module("cls", std::make_shared<Module>());
  auto predictions = cls->register_module("predictions", std::make_shared<Module>());
  // Note [Tied MLM decoder]: no decoder weight here; forward() uses word_embeddings_->weight.
  decoder_bias_ = predictions->register_parameter("bias", torch::zeros({c.vocab_size}));
  auto transform = predictions->register_module("transform", std::make_shared<Module>());
  transform_ = transform->register_module("dense", torch::nn::Linear(h, h));
  transform_norm_ = transform->register_module("LayerNorm", ln());
  if (c.nsp) seq_relationship_ = cls->register_module("seq_relationship", torch::nn::Linear(h, 2));
  if (units_) {
    embeddings_unit_ = units_->add_module("embeddings", embeddings);
    if (pooler_) pooler_unit_ = units_->add_module("pooler", pooler_);
    auto heads = cls->parameters(/*recurse=*/true);
    heads.push_back(word_embeddings_->weight);  // the tied decoder
    heads_unit_ = units_->add("heads", heads);
  }
  init_weights();
}

// BERT's initialisation: N(0, initializer_range) weights, zero biases, LayerNorm (1, 0).
void BertForPreTrainingImpl::init_weights() {
  torch::NoGradGuard no_grad;
  for (auto& p : named_parameters()) {
    const std::string& name = p.key();
    auto ends_with = [&](const std::string& s) {
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    if (ends_with("LayerNorm.weight")) p.value().fill_(1.0);
    else if (ends_with("bias")) p.value().zero_();
    else p.value().normal_(0.0, config_.initializer_range);
  }
}

void BertForPreTrainingImpl::set_recompute(bool on) {
  recompute_ = on;
  if (!units_) return;
  for (size_t i = 0; i < layers_.size(); ++i) units_->set_recompute(static_cast<int>(i), on);
}

int64_t BertForPreTrainingImpl::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

std::pair<at::Tensor, at::Tensor> BertForPreTrainingImpl::encode(const at::Tensor& input_ids,
                                                                 const at::Tensor& token_type_ids,
                                                                 const at::Tensor& attention_mask) {
  const int64_t B = input_ids.size(0), T = input_ids.size(1);
  if (T > config_.max_position_embeddings) {
    throw std::invalid_argument("BERT: sequence length " + std::to_string(T) +
                                " exceeds max_position_embeddings " +
                                std::to_string(config_.max_position_embeddings));
  }
  const auto positions = torch::arange(T, input_ids.options()).unsqueeze(0);
  auto x = in_unit(embeddings_unit_, [&] {
    BERT_PHASE("embeddings");
    auto e = word_embeddings_(input_ids) + position_embeddings_(positions) +
             token_type_embeddings_(token_type_ids);
    {
      BERT_PHASE("layernorm");
      e = embeddings_norm_(e);
    }
    return embeddings_dropout_(e);
  });
  // Additive mask: 0 on tokens, -10000 on padding (as the reference implementation). None when
  // every token is real: it would add -0.0 to every score (no change) in a pass per layer. Asked
  // on the CPU only, where it costs no device synchronisation.
  at::Tensor mask_bias;
  if (!attention_mask.is_cpu() || attention_mask.eq(0).any().item<bool>()) {
    mask_bias = ((1.0 - attention_mask.to(x.scalar_type())) * -10000.0).view({B, 1, 1, T});
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto run_layer = [layer = layers_[i], mask_bias](const std::vector<at::Tensor>& in) {
      return layer.ptr()->forward(in[0], mask_bias);  // ptr(): the call is not const
    };
    // Recomputed in backward after set_recompute(true): through run(i, fn, inputs) when the
    // layer is a declared unit, else through shardopt::recompute itself.
    if (units_) {
      x = units_->run(static_cast<int>(i), run_layer, {x});
    } else {
      x = recompute_ ? shardopt::recompute(run_layer, {x}) : run_layer({x});
    }
  }
  at::Tensor pooled;
  if (pooler_) {
    pooled = in_unit(pooler_unit_, [&] { return torch::tanh(linear(pooler_, x.select(1, 0))); });
  }
  return {x, pooled};
}

BertOutputs BertForPreTrainingImpl::forward(const BertInputs& in) {
  auto [sequence, pooled] = encode(in.input_ids, in.token_type_ids, in.attention_mask);
  const int64_t B = sequence.size(0), T = sequence.size(1), H = sequence.size(2);
  BertOutputs out;
  const auto labels = in.masked_labels.reshape({-1});
  const auto valid = labels.ne(-100).nonzero().squeeze(1);
  const auto rows = (in.masked_positions +
                     torch::arange(B, in.masked_positions.options()).unsqueeze(1) * T)
                        .reshape({-1})
                        .index_select(0, valid);
  at::Tensor h;
  if (config_.mlm_all_positions) {
    // Every position, labels -100 where nothing was masked (HF BertForMaskedLM).
    h = sequence.reshape({B * T, H});
    out.mlm_labels = torch::full({B * T}, -100, labels.options())
                         .index_copy_(0, rows, labels.index_select(0, valid));
  } else {
    // Only at the real masked positions (Google's gather_indexes, padding dropped).
    h = sequence.reshape({B * T, H}).index_select(0, rows);
    out.mlm_labels = labels.index_select(0, valid);
  }
  std::tie(out.mlm_logits, out.nsp_logits) = in_unit(heads_unit_, [&] {
    at::Tensor t;
    {
      BERT_PHASE("head_transform");
      t = activation(linear(transform_, h), config_.hidden_act);
    }
    {
      BERT_PHASE("layernorm");
      t = transform_norm_(t);
    }
    BERT_PHASE("decoder");
    return std::make_tuple(torch::linear(t, word_embeddings_->weight, decoder_bias_),
                           seq_relationship_ ? linear(seq_relationship_, pooled) : at::Tensor());
  });
  {
    BERT_PHASE("loss");
    auto logits = out.mlm_logits.to(torch::kFloat);
    auto labels_in = out.mlm_labels;
    if (config_.mlm_all_positions) {
      // Every position has logits, but only the labelled rows enter the loss (in row order, as
      // cross_entropy meets them): the other rows' log-probabilities would be computed and thrown
      // away (ignore_index: their loss term and gradient are exactly zero), ~85% of a [B*T, vocab]
      // log-softmax each way. The logits' gradient is still [B*T, vocab], zero on those rows.
      const auto labelled = out.mlm_labels.ne(-100).nonzero().squeeze(1);
      logits = logits.index_select(0, labelled);
      labels_in = out.mlm_labels.index_select(0, labelled);
    }
    out.mlm_loss = F::cross_entropy(logits, labels_in);
  }
  if (seq_relationship_) {
    out.nsp_loss = F::cross_entropy(out.nsp_logits.to(torch::kFloat), in.nsp_labels);
    out.loss = out.mlm_loss + out.nsp_loss;
  } else {
    out.nsp_loss = torch::zeros({}, out.mlm_loss.options());
    out.loss = out.mlm_loss;
  }
  return out;
}

}  // namespace bert
