// BertConfig: the architecture of the example's BERT, the named configs (presets) and the
// bert_config.json / config.json files that describe it. Torch-free: the option checks read a
// config on every rank before any work.
//
// Note [BERT config files]: Google's bert_config.json and Hugging Face's config.json share the key
// names (vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
// hidden_act, hidden_dropout_prob, attention_probs_dropout_prob, max_position_embeddings,
// type_vocab_size, initializer_range; HF adds layer_norm_eps). A value this model cannot run
// (another activation, relative positions, a decoder) is an error naming the key; keys that do
// not change the pretraining model (pad_token_id, torch_dtype, ...) are ignored and listed.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace bert {

struct BertConfig {
  std::string name = "base";  // the preset's name, or the config file's path
  int64_t vocab_size = 30522;
  int64_t hidden_size = 768;
  int64_t num_layers = 12;
  int64_t num_heads = 12;
  int64_t intermediate_size = 3072;
  int64_t max_position_embeddings = 512;
  int64_t type_vocab_size = 2;
  std::string hidden_act = "gelu";  // gelu (erf), gelu_new (tanh approximation), relu
  double hidden_dropout = 0.1;
  double attention_dropout = 0.1;
  double layer_norm_eps = 1e-12;
  double initializer_range = 0.02;
  // Pooler and next-sentence head; off for MLM-only training (no parameters, nsp_loss 0).
  bool nsp = true;
  // MLM logits at every position with ignore_index -100 (Hugging Face BertForMaskedLM) rather
  // than only at the masked ones (Google's gather_indexes): same loss, ~6x the decoder's work.
  bool mlm_all_positions = false;
  // Attention as Hugging Face names it: "sdpa" (torch's fused scaled_dot_product_attention, torch
  // 2.1 and later), "eager" (matmul, softmax, dropout, matmul) or "auto" (sdpa where this torch
  // has it, else eager; the model resolves it). A run choice, not a file key.
  std::string attn_implementation = "auto";

  // The named configs: the shapes of shardopt::estimate::bert_preset (one table for the
  // estimator and the example): tiny, mini, small, base, large, and peer (mini without the NSP
  // head, MLM logits at every position: the PyTorch peer's model). Vocabulary 30522, 512
  // positions, BERT's dropout 0.1. Throws std::invalid_argument for other names.
  static BertConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
  // Throws std::invalid_argument naming the first inconsistent field.
  void validate() const;

  // Reads a bert_config.json / config.json (Note [BERT config files]). Throws
  // std::invalid_argument naming the file and the key; `ignored` receives the keys left unused.
  static BertConfig from_json(const nlohmann::json& j, const std::string& source,
                              std::vector<std::string>* ignored = nullptr);
  static BertConfig load(const std::string& path, std::vector<std::string>* ignored = nullptr);
  // Hugging Face's config.json: "architectures": ["BertForPreTraining"] (["BertForMaskedLM"]
  // without the NSP head), "model_type": "bert" and the keys above; loadable by from_json and by
  // transformers' BertConfig.
  nlohmann::json to_hf_json() const;
};

// The activations the model implements (hidden_act values).
const std::vector<std::string>& supported_activations();

}  // namespace bert
