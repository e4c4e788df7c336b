// BERT's standard artifacts in and out: --init-checkpoint (a consolidated model.pt, a shardopt
// checkpoint directory, or a Hugging Face model.safetensors / state dict) and --export-hf (a
// directory Hugging Face's BertForPreTraining.from_pretrained loads: config.json, the weights
// with the tied decoder keys as shardopt::export_hf_safetensors writes them, vocab.txt and the
// tokenizer's two files).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/ordered_dict.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "bert_config.hpp"
#include "model.hpp"
#include "shardopt/checkpoint.hpp"
#include "shardopt/hf_export.hpp"

namespace bert {

using StateDict = torch::OrderedDict<std::string, at::Tensor>;

// The state dict at `path`: a *.safetensors file (or a directory holding model.safetensors, or
// model.safetensors.index.json and its files, as --export-hf writes), a shardopt checkpoint directory (its fp32 master parameters), or a file
// torch.save / shardopt::consolidate_checkpoint wrote. `kind` receives what it was. Throws
// std::invalid_argument naming the path and the problem.
StateDict read_init_checkpoint(const std::string& path, std::string* kind = nullptr);

struct InitReport {
  int64_t loaded = 0;                   // parameters taken from the checkpoint
  std::vector<std::string> missing;     // the model's parameters it lacks (initialised as usual)
  std::vector<std::string> unexpected;  // its tensors the model has no place for
  std::vector<std::string> ignored;     // tied copies and buffers (decoder, position_ids)
};

// Copies the checkpoint's tensors into the model's parameters by Hugging Face name, before the
// optimizer is built. Names are normalised as transformers does: a "module." prefix dropped,
// BertModel's names ("embeddings.", "encoder.", "pooler.") under "bert.", TF-converted
// LayerNorm "gamma"/"beta" as "weight"/"bias". A shape that differs is an error naming the key
// and both shapes (std::invalid_argument); a missing pooler or NSP head (a fine-tuned BERT) is
// only reported.
InitReport load_pretrained(BertForPreTraining& model, const StateDict& state);

// "[bert] init checkpoint: PATH (KIND): N parameters loaded" and the missing, unexpected and
// ignored names, for the log.
void print_init_report(const std::string& path, const std::string& kind, const InitReport& r);

// The model's buffers, frozen parameters and tied aliases (tied_aliases()) for
// shardopt::save_checkpoint, so that a checkpoint's consolidated model.pt holds the whole state
// dict: load_state_dict_strict takes it, and so does torch's load_state_dict(strict=True) of
// Hugging Face's BertForPreTraining.
shardopt::SaveOptions model_save_options(BertForPreTraining& model);

// torch's load_state_dict(strict=True) for the example's model: `state` holds exactly the
// model's parameters, buffers and tied aliases, each of its shape, every alias equal to the
// tensor it names; then the values are copied in. Otherwise throws std::invalid_argument listing
// the missing and unexpected keys, or naming the key of a shape or tied copy that differs.
void load_state_dict_strict(BertForPreTraining& model, const StateDict& state);

// The export's names of the example's parameters (shardopt::HfExportOptions::names): the two
// that the tied decoder shares (tied_aliases()) under their own and the decoder's names.
std::map<std::string, std::vector<std::string>> hf_names();

// Hugging Face BertForPreTraining's state dict of the model's full parameters (given by the
// example's names, e.g. consolidated or gathered): fp32, contiguous, on the CPU, with the tied
// cls.predictions.decoder.weight (the word embeddings) and cls.predictions.decoder.bias
// (cls.predictions.bias) added as copies (hf_names()).
std::vector<std::pair<std::string, at::Tensor>> hf_state_dict(const StateDict& params);

// What --export-hf gives shardopt::export_hf_safetensors: hf_names(), and as write_extra
// config.json (config.to_hf_json()) and, with a vocabulary, vocab.txt, tokenizer_config.json
// (do_lower_case, model_max_length) and special_tokens_map.json; `extra_files`, when given, gets
// their names as they are written (world rank 0).
shardopt::HfExportOptions hf_export_options(const BertConfig& config, const std::string& vocab_path,
                                            bool lower_case,
                                            std::vector<std::string>* extra_files = nullptr);

// One process: writes `dir` from the model's full parameters with export_hf_safetensors and
// hf_export_options (model.safetensors, or k-of-n files and the index past 5 GB). Returns the
// files written, the extra ones first.
std::vector<std::string> export_hf(const std::string& dir, const BertConfig& config,
                                   const StateDict& params, const std::string& vocab_path,
                                   bool lower_case);

// at::Tensor <-> safetensors files (safetensors.hpp does the format).
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors);
StateDict read_safetensors(const std::string& path);

}  // namespace bert
