// BERT encoder, pooler, MLM and NSP heads (see model.hpp for names and the tied decoder).
#include "model.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include "shardopt/pipeline_runner.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <optional>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

// scaled_dot_product_attention with its scale argument: torch 2.1.
#if defined(TORCH_VERSION_MAJOR) && \
    (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1))
#define BERT_HAS_SDPA 1
#else
#define BERT_HAS_SDPA 0
#endif

namespace bert {

namespace F = torch::nn::functional;
namespace tp = shardopt::tp;
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

at::Tensor Dense::operator()(const at::Tensor& x) const {
  if (column) return column.ptr()->forward(x);
  if (row) return row.ptr()->forward(x);
  return linear(plain, x);
}

// Dropout; inside a split region (Note [Tensor-parallel BERT]) from this tensor rank's stream.
static at::Tensor dropout(torch::nn::Dropout& d, const at::Tensor& x, const ModelParallel& mp,
                          bool split_region) {
  if (!split_region || !mp.rng) return d(x);
  const auto fork = mp.rng->fork();
  return d(x);
}

// A LayerNorm applied to sequence shards: its gradient summed over the tensor group.
static void mark_sequence_parallel(const torch::nn::LayerNorm& norm, const ModelParallel& mp) {
  if (!mp.tp.sequence_parallel) return;
  tp::mark_sequence_parallel(norm->weight, mp.tp.group);
  tp::mark_sequence_parallel(norm->bias, mp.tp.group);
}

std::string resolve_attn_implementation(const std::string& requested) {
  if (requested == "auto") return BERT_HAS_SDPA ? "sdpa" : "eager";
  if (requested == "sdpa" && !BERT_HAS_SDPA) {
    throw std::invalid_argument(fmt::format(
        "attn_implementation 'sdpa' needs torch 2.1 or later (scaled_dot_product_attention); this "
        "build has torch {}: use 'eager' or 'auto'", TORCH_VERSION));
  }
  return requested;
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

BertLayerImpl::BertLayerImpl(const BertConfig& c, const ModelParallel& mp)
    : mp_(mp),
      heads_(c.num_heads / mp.size()),
      head_dim_(c.hidden_size / c.num_heads),
      act_(c.hidden_act) {
  const int64_t h = c.hidden_size;
  auto ln = [&] { return torch::nn::LayerNorm(torch::nn::LayerNormOptions({h}).eps(c.layer_norm_eps)); };
  // The split kind of each projection (Note [Tensor-parallel BERT]); plain Linear at T = 1.
  enum Kind { kColumn, kRow };
  auto dense = [&](Module& parent, const char* name, int64_t in, int64_t out, Kind kind) {
    Dense d;
    if (!mp.tp.group) {
      d.plain = parent.register_module(name, torch::nn::Linear(in, out));
    } else if (kind == kColumn) {
      d.column = parent.register_module(name, tp::ColumnParallelLinear(in, out, mp.tp));
    } else {
      d.row = parent.register_module(name, tp::RowParallelLinear(in, out, mp.tp));
    }
    return d;
  };
  // Plain modules only to reproduce the reference parameter names.
  auto attention = register_module("attention", std::make_shared<Module>());
  auto self = attention->register_module("self", std::make_shared<Module>());
  query_ = dense(*self, "query", h, h, kColumn);
  key_ = dense(*self, "key", h, h, kColumn);
  value_ = dense(*self, "value", h, h, kColumn);
  auto attention_output = attention->register_module("output", std::make_shared<Module>());
  attn_dense_ = dense(*attention_output, "dense", h, h, kRow);
  attn_norm_ = attention_output->register_module("LayerNorm", ln());
  auto intermediate = register_module("intermediate", std::make_shared<Module>());
  intermediate_ = dense(*intermediate, "dense", h, c.intermediate_size, kColumn);
  auto output = register_module("output", std::make_shared<Module>());
  output_ = dense(*output, "dense", c.intermediate_size, h, kRow);
  output_norm_ = output->register_module("LayerNorm", ln());
  mark_sequence_parallel(attn_norm_, mp);
  mark_sequence_parallel(output_norm_, mp);
  sdpa_ = resolve_attn_implementation(c.attn_implementation) == "sdpa";
  attn_dropout_ = register_module("attention_dropout", torch::nn::Dropout(c.attention_dropout));
  hidden_dropout_ = register_module("hidden_dropout", torch::nn::Dropout(c.hidden_dropout));
}

// Under tensor parallelism x is [B, T/t, H] with sequence parallelism, and q, k, v and the
// context hold this rank's heads: [B, T, H/t].
at::Tensor BertLayerImpl::forward(const at::Tensor& x, const at::Tensor& mask_bias) {
  const int64_t B = x.size(0);
  const int64_t local_h = heads_ * head_dim_;
  const bool sp = mp_.tp.sequence_parallel;
  auto split = [&](const at::Tensor& t) {  // [B, T, h] -> [B, heads, T, head_dim]
    return t.view({B, -1, heads_, head_dim_}).transpose(1, 2);
  };
  at::Tensor q, k, v, scores, probs, context, attended, out;
  {
    BERT_PHASE("qkv");
    if (query_.column) {  // one product, one input-gradient all-reduce (Megatron's fused QKV)
      const auto qkv =
          tp::fused_column_forward(x, {query_.column, key_.column, value_.column});
      q = split(qkv[0]), k = split(qkv[1]), v = split(qkv[2]);
    } else {
      q = split(query_(x)), k = split(key_(x)), v = split(value_(x));
    }
  }
  const double scale = 1.0 / std::sqrt(double(head_dim_));
#if BERT_HAS_SDPA
  if (sdpa_) {
    // Note [Fused attention]: one call; on the CPU its flash kernel runs when no dropout applies
    // (eval, or attention dropout 0), otherwise torch falls back to the same matmul, softmax,
    // dropout and matmul as the eager branch. The dropout draws from the tensor-parallel region's
    // generator as the eager branch's does.
    BERT_PHASE("attention");
    const double p = is_training() ? attn_dropout_->options.p() : 0.0;
    std::optional<tp::RngTracker::Fork> fork;
    if (p > 0 && mp_.rng) fork.emplace(*mp_.rng);
    const auto mask = mask_bias.defined() ? c10::optional<at::Tensor>(mask_bias) : c10::nullopt;
    context = at::scaled_dot_product_attention(q, k, v, mask, p, /*is_causal=*/false, scale)
                  .transpose(1, 2)
                  .reshape({B, -1, local_h});
  } else
#endif
  {
    {
      BERT_PHASE("scores");
      scores = torch::matmul(q, k.transpose(-1, -2)) * scale;
      if (mask_bias.defined()) scores = scores + mask_bias;
    }
    {
      BERT_PHASE("softmax");
      probs = dropout(attn_dropout_, torch::softmax(scores, -1), mp_, /*split_region=*/true);
    }
    {
      BERT_PHASE("context");
      context = torch::matmul(probs, v).transpose(1, 2).reshape({B, -1, local_h});
    }
  }
  {
    BERT_PHASE("attn_out");
    attended = dropout(hidden_dropout_, attn_dense_(context), mp_, sp) + x;
  }
  {
    BERT_PHASE("layernorm");
    attended = attn_norm_(attended);
  }
  {
    BERT_PHASE("ffn");
    const auto inner = activation(intermediate_(attended), act_);
    out = dropout(hidden_dropout_, output_(inner), mp_, sp) + attended;
  }
  BERT_PHASE("layernorm");
  return output_norm_(out);
}

// ---- the whole model --------------------------------------------------------------------------

namespace {

// The generator's state, so that a split model draws what the unsplit one does.
at::Tensor cpu_generator_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}
void set_cpu_generator_state(const at::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

void check_divisible(const char* what, int64_t n, int t) {
  if (n % t != 0) {
    throw std::invalid_argument(fmt::format(
        "BERT: {} {} is not divisible by the tensor-parallel size {} (--tp)", what, n, t));
  }
}

}  // namespace

BertForPreTrainingImpl::BertForPreTrainingImpl(const BertConfig& c, bool declare_units,
                                               ModelParallel mp)
    : config_(c), mp_(std::move(mp)),
      units_(declare_units ? std::make_shared<shardopt::Units>() : nullptr) {
  c.validate();
  const int t = mp_.size();
  check_divisible("num_attention_heads", c.num_heads, t);
  check_divisible("intermediate_size", c.intermediate_size, t);
  // Note [Tensor-parallel BERT]: the vocabulary padded so that it splits evenly.
  const int64_t vocab = t > 1 ? tp::padded_vocab(c.vocab_size, t) : c.vocab_size;
  const at::Tensor generator_at_start = t > 1 ? cpu_generator_state() : at::Tensor();
  const int64_t h = c.hidden_size;
  auto ln = [&] { return torch::nn::LayerNorm(torch::nn::LayerNormOptions({h}).eps(c.layer_norm_eps)); };
  auto bert = register_module("bert", std::make_shared<Module>());
  auto embeddings = bert->register_module("embeddings", std::make_shared<Module>());
  if (t > 1) {
    split_word_embeddings_ = embeddings->register_module(
        "word_embeddings", tp::VocabParallelEmbedding(vocab, h, mp_.tp));
    word_embedding_ = split_word_embeddings_->weight;
  } else {
    word_embeddings_ = embeddings->register_module("word_embeddings", torch::nn::Embedding(vocab, h));
    word_embedding_ = word_embeddings_->weight;
  }
  // The lookup's and the MLM decoder's weight: under pipelines the first and the last stage each
  // hold a copy, which the optimizer keeps equal (Note [Pipelined BERT]).
  shardopt::mark_pipeline_shared(word_embedding_);
  position_embeddings_ = embeddings->register_module(
      "position_embeddings", torch::nn::Embedding(c.max_position_embeddings, h));
  token_type_embeddings_ = embeddings->register_module(
      "token_type_embeddings", torch::nn::Embedding(c.type_vocab_size, h));
  embeddings_norm_ = embeddings->register_module("LayerNorm", ln());
  mark_sequence_parallel(embeddings_norm_, mp_);
  embeddings_dropout_ = embeddings->register_module("dropout", torch::nn::Dropout(c.hidden_dropout));

  auto encoder = bert->register_module("encoder", std::make_shared<Module>());
  auto list = encoder->register_module("layer", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_layers; ++i) {
    layers_.emplace_back(c, mp_);
    list->push_back(layers_.back());
    if (units_) units_->add_module("layer" + std::to_string(i), layers_.back());
  }
  if (c.nsp) {
    auto pooler = bert->register_module("pooler", std::make_shared<Module>());
    pooler_ = pooler->register_module("dense", torch::nn::Linear(h, h));
  }

  auto cls = register_module("cls", std::make_shared<Module>());
  auto predictions = cls->register_module("predictions", std::make_shared<Module>());
  // Note [Tied MLM decoder]: no decoder weight here; forward() uses word_embedding_.
  decoder_bias_ = predictions->register_parameter("bias", torch::zeros({vocab / t}));
  auto transform = predictions->register_module("transform", std::make_shared<Module>());
  transform_ = transform->register_module("dense", torch::nn::Linear(h, h));
  transform_norm_ = transform->register_module("LayerNorm", ln());
  if (c.nsp) seq_relationship_ = cls->register_module("seq_relationship", torch::nn::Linear(h, 2));
  if (units_) {
    embeddings_unit_ = units_->add_module("embeddings", embeddings);
    if (pooler_) pooler_unit_ = units_->add_module("pooler", pooler_);
    auto heads = cls->parameters(/*recurse=*/true);
    heads.push_back(word_embedding_);  // the tied decoder
    heads_unit_ = units_->add("heads", heads);
  }
  if (t == 1) {
    init_weights();
    return;
  }
  // The split layers recorded their parameters' splits (Note [Split records] in
  // shardopt/tensor_parallel.hpp); the vocabulary's padding and the decoder bias are the model's.
  tp::mark_split(word_embedding_, mp_.tp.group, 0, c.vocab_size, vocab);
  tp::mark_split(decoder_bias_, mp_.tp.group, 0, c.vocab_size, vocab);
  // Start from the unsplit model's values: the one a T = 1 run builds from the same generator
  // state, leaving the generator where that run leaves it.
  set_cpu_generator_state(generator_at_start);
  BertForPreTraining unsplit(c, /*declare_units=*/false);
  load_unsplit(unsplit->named_parameters());
}

void BertForPreTrainingImpl::load_unsplit(const torch::OrderedDict<std::string, at::Tensor>& unsplit) {
  torch::NoGradGuard no_grad;
  for (auto& p : named_parameters()) {
    const at::Tensor* source = unsplit.find(p.key());
    if (source == nullptr) {
      throw std::invalid_argument(fmt::format("BERT: the unsplit parameters lack '{}'", p.key()));
    }
    p.value().copy_(slice_of(p.key(), *source));
  }
}

at::Tensor BertForPreTrainingImpl::slice_of(const std::string& name, const at::Tensor& unsplit) const {
  const at::Tensor* param = named_parameters().find(name);
  if (param == nullptr) throw std::invalid_argument(fmt::format("BERT: no parameter '{}'", name));
  const auto split = tp::split_of(*param);  // Note [Split records]
  std::vector<int64_t> expected = param->sizes().vec();
  if (split) expected[split->dim] = split->full_size;
  if (unsplit.sizes().vec() != expected) {
    throw std::invalid_argument(fmt::format("BERT: unsplit '{}' must be [{}], got [{}]", name,
                                            fmt::join(expected, ", "),
                                            fmt::join(unsplit.sizes(), ", ")));
  }
  if (!split) return unsplit;
  at::Tensor padded = unsplit;
  if (split->padded_size > split->full_size) {  // the padding rows start at zero
    auto sizes = unsplit.sizes().vec();
    sizes[split->dim] = split->padded_size;
    padded = torch::zeros(sizes, unsplit.options());
    padded.narrow(split->dim, 0, split->full_size).copy_(unsplit);
  }
  return padded.chunk(mp_.size(), split->dim)[mp_.tp.group->rank()];
}

torch::OrderedDict<std::string, at::Tensor> BertForPreTrainingImpl::unsplit_parameters() {
  torch::NoGradGuard no_grad;
  torch::OrderedDict<std::string, at::Tensor> out;
  const int t = mp_.size();
  for (const auto& p : named_parameters()) {
    const auto split = tp::split_of(p.value());
    if (!split) {
      out.insert(p.key(), p.value());
      continue;
    }
    // Rank-major all-gather of the chunks laid along dimension 0, then put back.
    const at::Tensor local = p.value().movedim(split->dim, 0).contiguous();
    at::Tensor all = torch::empty({t * local.numel()}, local.options());
    mp_.tp.group->all_gather(local.reshape({-1}), all);
    auto sizes = local.sizes().vec();
    sizes[0] *= t;
    out.insert(p.key(), all.view(sizes)
                            .narrow(0, 0, split->full_size)
                            .movedim(0, split->dim)
                            .contiguous());
  }
  return out;
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
  at::Tensor x = embed(input_ids, token_type_ids);
  x = run_layers(x, mask_bias(attention_mask, x.scalar_type()), 0,
                 static_cast<int64_t>(layers_.size()));
  x = whole_sequence(x);
  return {x, pool(x)};
}

at::Tensor BertForPreTrainingImpl::whole_sequence(const at::Tensor& x) const {
  return mp_.tp.sequence_parallel ? tp::gather_from_region(x, 1, mp_.tp.group) : x;
}

at::Tensor BertForPreTrainingImpl::embed(const at::Tensor& input_ids,
                                         const at::Tensor& token_type_ids) {
  const int64_t T = input_ids.size(1);
  if (T > config_.max_position_embeddings) {
    throw std::invalid_argument("BERT: sequence length " + std::to_string(T) +
                                " exceeds max_position_embeddings " +
                                std::to_string(config_.max_position_embeddings));
  }
  const bool sp = mp_.tp.sequence_parallel;
  if (sp && T % mp_.size() != 0) {
    throw std::invalid_argument(fmt::format(
        "BERT: sequence parallelism splits the sequence over the {} tensor ranks: the sequence "
        "length {} must be divisible by it (--max-seq-length)", mp_.size(), T));
  }
  const auto positions = torch::arange(T, input_ids.options()).unsqueeze(0);
  return in_unit(embeddings_unit_, [&] {
    BERT_PHASE("embeddings");
    at::Tensor e;
    if (split_word_embeddings_) {  // Note [Tensor-parallel BERT]: this rank's part of the sum
      auto replicated = position_embeddings_(positions) + token_type_embeddings_(token_type_ids);
      if (sp) replicated = tp::scatter_to_region(replicated, 1, mp_.tp.group);
      e = split_word_embeddings_(input_ids) + replicated;
    } else {
      e = word_embeddings_(input_ids) + position_embeddings_(positions) +
          token_type_embeddings_(token_type_ids);
    }
    {
      BERT_PHASE("layernorm");
      e = embeddings_norm_(e);
    }
    return dropout(embeddings_dropout_, e, mp_, sp);
  });
}

// Additive mask: 0 on tokens, -10000 on padding (as the reference implementation). None when
// every token is real: it would add -0.0 to every score (no change) in a pass per layer. Asked
// on the CPU only, where it costs no device synchronisation.
at::Tensor BertForPreTrainingImpl::mask_bias(const at::Tensor& attention_mask,
                                             at::ScalarType dtype) const {
  if (attention_mask.is_cpu() && !attention_mask.eq(0).any().item<bool>()) return {};
  const int64_t B = attention_mask.size(0), T = attention_mask.size(1);
  return ((1.0 - attention_mask.to(dtype)) * -10000.0).view({B, 1, 1, T});
}

at::Tensor BertForPreTrainingImpl::run_layers(at::Tensor x, const at::Tensor& mask_bias,
                                              int64_t first, int64_t last) {
  for (int64_t i = first; i < last; ++i) {
    auto run_layer = [layer = layers_.at(i), mask_bias](const std::vector<at::Tensor>& in) {
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
  return x;
}

at::Tensor BertForPreTrainingImpl::pool(const at::Tensor& sequence) {
  if (!pooler_) return {};
  return in_unit(pooler_unit_, [&] { return torch::tanh(linear(pooler_, sequence.select(1, 0))); });
}

BertOutputs BertForPreTrainingImpl::forward(const BertInputs& in) {
  auto [sequence, pooled] = encode(in.input_ids, in.token_type_ids, in.attention_mask);
  return heads(sequence, pooled, in);
}

BertOutputs BertForPreTrainingImpl::heads(const at::Tensor& sequence, const at::Tensor& pooled,
                                          const BertInputs& in) {
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
    return std::make_tuple(decoder_logits(t),
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
    out.mlm_loss = mlm_cross_entropy(logits, labels_in);
  }
  out.mlm_predictions = mlm_predictions(out.mlm_logits);
  if (seq_relationship_) {
    out.nsp_loss = F::cross_entropy(out.nsp_logits.to(torch::kFloat), in.nsp_labels);
    out.loss = out.mlm_loss + out.nsp_loss;
  } else {
    out.nsp_loss = torch::zeros({}, out.mlm_loss.options());
    out.loss = out.mlm_loss;
  }
  return out;
}

// The tied decoder: at T > 1 a column-parallel product with this rank's embedding rows, whose
// padding columns are masked out (Note [Tensor-parallel BERT]).
at::Tensor BertForPreTrainingImpl::decoder_logits(const at::Tensor& t) {
  if (mp_.size() == 1) return torch::linear(t, word_embedding_, decoder_bias_);
  at::Tensor logits = torch::linear(tp::copy_to_region(t, mp_.tp.group), word_embedding_, decoder_bias_);
  const int64_t columns = logits.size(-1);
  const int64_t real = std::clamp<int64_t>(
      config_.vocab_size - split_word_embeddings_->vocab_begin(), 0, columns);
  if (real == columns) return logits;
  const auto padding = torch::arange(columns, logits.options().dtype(torch::kLong)) >= real;
  return logits.masked_fill(padding, -std::numeric_limits<double>::infinity());
}

// Mean cross entropy of the labelled rows (no -100 among `labels`).
at::Tensor BertForPreTrainingImpl::mlm_cross_entropy(const at::Tensor& logits,
                                                     const at::Tensor& labels) {
  if (mp_.size() == 1) return F::cross_entropy(logits, labels);
  return tp::vocab_parallel_cross_entropy(logits, labels, mp_.tp.group).mean();
}

// The argmax over the whole vocabulary; at T > 1 the largest of the ranks' maxima, the lowest
// index among equals (as argmax picks the first).
at::Tensor BertForPreTrainingImpl::mlm_predictions(const at::Tensor& logits) {
  torch::NoGradGuard no_grad;
  if (mp_.size() == 1) return logits.argmax(-1);
  auto [value, index] = logits.to(torch::kFloat).max(-1);
  at::Tensor best = value.contiguous();
  mp_.tp.group->all_reduce(best, shardopt::ReduceOp::Max);
  const double begin = static_cast<double>(split_word_embeddings_->vocab_begin());
  at::Tensor candidate = torch::where(value.eq(best), index.to(torch::kDouble) + begin,
                                      torch::full_like(best, std::numeric_limits<double>::max(),
                                                       torch::kDouble))
                             .contiguous();
  mp_.tp.group->all_reduce(candidate, shardopt::ReduceOp::Min);
  return candidate.to(torch::kLong);
}

}  // namespace bert
