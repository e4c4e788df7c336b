// BERT's formats, one process: config files (Google's and HF's keys, errors naming the key),
// safetensors (round trip, corrupt files), --init-checkpoint's name matching and the HF state
// dict's tied keys, strict loading of the whole state dict. The trainer-level checks are
// tests/example/bert_formats_test.sh and BertCli.ModelPtLoadsStrictlyInCppAndPython.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "bert_config.hpp"
#include "model.hpp"
#include "pretrained.hpp"
#include "shardopt/safetensors.hpp"

namespace bert {
namespace {

namespace safetensors = shardopt::safetensors;  // the library's reader and writer

namespace fs = std::filesystem;

nlohmann::json google_config() {
  return nlohmann::json::parse(R"({
    "attention_probs_dropout_prob": 0.1, "directionality": "bidi", "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "hidden_size": 768, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 512, "num_attention_heads": 12,
    "num_hidden_layers": 12, "pooler_fc_size": 768, "type_vocab_size": 2, "vocab_size": 119547})");
}

std::string error_of(const nlohmann::json& j) {
  try {
    BertConfig::from_json(j, "cfg.json");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(BertConfigFile, ReadsGoogleKeysAndListsTheOthers) {
  std::vector<std::string> ignored;
  const BertConfig c = BertConfig::from_json(google_config(), "bert_config.json", &ignored);
  EXPECT_EQ(c.vocab_size, 119547);
  EXPECT_EQ(c.num_layers, 12);
  EXPECT_EQ(c.num_heads, 12);
  EXPECT_EQ(c.intermediate_size, 3072);
  EXPECT_EQ(c.hidden_act, "gelu");
  EXPECT_DOUBLE_EQ(c.layer_norm_eps, 1e-12);  // Google's file has none: BERT's
  EXPECT_TRUE(c.nsp);
  EXPECT_EQ(ignored, (std::vector<std::string>{"directionality", "pooler_fc_size"}));
}

TEST(BertConfigFile, ErrorsNameTheFileAndTheKey) {
  auto with = [](const char* key, const nlohmann::json& v) {
    auto j = google_config();
    if (v.is_null()) j.erase(key);
    else j[key] = v;
    return error_of(j);
  };
  EXPECT_EQ(with("hidden_size", nullptr),
            "cfg.json: 'hidden_size' is missing (a BERT config names the model's shape)");
  EXPECT_EQ(with("hidden_act", "swish"),
            "cfg.json: 'hidden_act' \"swish\" is not supported (supported: gelu, gelu_new, "
            "gelu_pytorch_tanh, relu)");
  EXPECT_EQ(with("num_hidden_layers", 2.5),
            "cfg.json: 'num_hidden_layers' expected an integer in [1, 2147483647], got 2.5");
  EXPECT_EQ(with("hidden_dropout_prob", 1.5),
            "cfg.json: 'hidden_dropout_prob' expected a number in [0, 1), got 1.5");
  EXPECT_EQ(with("position_embedding_type", "relative_key"),
            "cfg.json: 'position_embedding_type' \"relative_key\" is not supported (only \"absolute\")");
  EXPECT_EQ(with("model_type", "roberta"), "cfg.json: 'model_type' \"roberta\" is not BERT (expected \"bert\")");
  EXPECT_EQ(with("is_decoder", true), "cfg.json: 'is_decoder' true is not supported (an encoder only)");
  // A JSON type error escaped as nlohmann's own exception before (tests/fuzz, issue 42).
  EXPECT_EQ(with("is_decoder", 1), "cfg.json: 'is_decoder' expected true or false, got 1");
  EXPECT_EQ(with("add_cross_attention", "no"),
            "cfg.json: 'add_cross_attention' expected true or false, got \"no\"");
  EXPECT_EQ(with("is_decoder", false), "");
  EXPECT_EQ(with("tie_word_embeddings", false),
            "cfg.json: 'tie_word_embeddings' false is not supported (this BERT's MLM decoder is "
            "always the word embedding matrix)");
  EXPECT_EQ(with("tie_word_embeddings", true), "");
  EXPECT_EQ(with("num_attention_heads", 5),
            "cfg.json: hidden_size (768) must be a multiple of num_attention_heads (5)");
  EXPECT_EQ(error_of(nlohmann::json::array()), "cfg.json: expected a JSON object (bert_config.json or config.json), got array");
}

TEST(BertConfigFile, HuggingFaceJsonRoundTrips) {
  for (const auto& name : BertConfig::preset_names()) {
    const BertConfig p = BertConfig::preset(name);
    const auto j = p.to_hf_json();
    EXPECT_EQ(j.at("model_type"), "bert");
    EXPECT_EQ(j.at("tie_word_embeddings"), true);  // what the model does; read back, not ignored
    EXPECT_EQ(j.at("architectures")[0], p.nsp ? "BertForPreTraining" : "BertForMaskedLM") << name;
    std::vector<std::string> ignored;
    const BertConfig r = BertConfig::from_json(j, "config.json", &ignored);
    EXPECT_EQ(ignored, (std::vector<std::string>{"pad_token_id", "torch_dtype"}));
    EXPECT_EQ(std::tie(r.vocab_size, r.hidden_size, r.num_layers, r.num_heads, r.intermediate_size,
                       r.max_position_embeddings, r.type_vocab_size, r.nsp),
              std::tie(p.vocab_size, p.hidden_size, p.num_layers, p.num_heads, p.intermediate_size,
                       p.max_position_embeddings, p.type_vocab_size, p.nsp)) << name;
    EXPECT_EQ(r.hidden_act, p.hidden_act);
    EXPECT_DOUBLE_EQ(r.layer_norm_eps, p.layer_norm_eps);
  }
}

TEST(BertConfigFile, PresetsAreTheEstimatorsTable) {
  const BertConfig base = BertConfig::preset("base");
  EXPECT_EQ(std::vector<int64_t>({base.num_layers, base.hidden_size, base.num_heads, base.intermediate_size}),
            std::vector<int64_t>({12, 768, 12, 3072}));
  const BertConfig peer = BertConfig::preset("peer");
  EXPECT_FALSE(peer.nsp);
  EXPECT_TRUE(peer.mlm_all_positions);
  EXPECT_THROW(BertConfig::preset("huge"), std::invalid_argument);
}

fs::path scratch(const std::string& name) {
  const auto dir = fs::temp_directory_path() / ("bert_formats_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir / name;
}

TEST(Safetensors, RoundTripsDtypesAndShapes) {
  const auto path = scratch("round.safetensors").string();
  const auto f = torch::randn({3, 5});
  const auto i = torch::arange(7, torch::kLong);
  const auto b = torch::randn({2, 2}).to(torch::kBFloat16);
  const auto empty = torch::zeros({0, 4});
  write_safetensors(path, {{"f", f}, {"i", i}, {"b", b}, {"e", empty}, {"t", f.t()}});
  const auto back = read_safetensors(path);
  ASSERT_EQ(back.size(), 5u);
  EXPECT_TRUE(torch::equal(back["f"], f));
  EXPECT_TRUE(torch::equal(back["i"], i));
  EXPECT_TRUE(torch::equal(back["b"], b));
  EXPECT_EQ(back["e"].sizes(), empty.sizes());
  EXPECT_TRUE(torch::equal(back["t"], f.t()));  // a non-contiguous view is written row-major
  const auto raw = safetensors::read(path);
  EXPECT_EQ(raw.metadata.at("format"), "pt");
  EXPECT_TRUE(safetensors::looks_like(path));
}

TEST(Safetensors, CorruptFilesAreRejectedNamingTheProblem) {
  const auto path = scratch("bad.safetensors").string();
  auto write_raw = [&](const std::string& header, size_t data_bytes, uint64_t claimed = 0) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    const uint64_t n = claimed ? claimed : header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header << std::string(data_bytes, '\0');
  };
  auto error = [&] {
    try {
      safetensors::read(path);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  write_raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, 1 << 30);
  EXPECT_NE(error().find("header length"), std::string::npos) << error();
  write_raw(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8);
  EXPECT_NE(error().find("'a': 12 bytes for shape [3] of F32, the offsets span 8"), std::string::npos) << error();
  write_raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8);
  EXPECT_NE(error().find("does not start where the previous tensor ends"), std::string::npos) << error();
  write_raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", 8);
  EXPECT_NE(error().find("outside the 8 data bytes"), std::string::npos) << error();
  write_raw(R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", 8);
  EXPECT_NE(error().find("unknown dtype 'Q4'"), std::string::npos) << error();
  write_raw("[1, 2]", 0);
  EXPECT_NE(error().find("not a JSON object"), std::string::npos) << error();
}

BertConfig small_config(int64_t intermediate = 32) {
  BertConfig c = BertConfig::preset("tiny");
  c.vocab_size = 40, c.hidden_size = 16, c.num_heads = 2, c.intermediate_size = intermediate;
  c.max_position_embeddings = 16;
  return c;
}

TEST(Pretrained, LoadsHuggingFaceNamesAndListsWhatItSkips) {
  torch::manual_seed(1);
  BertForPreTraining source(small_config());
  torch::manual_seed(2);
  BertForPreTraining target(small_config());
  // A BertModel-style state dict (no "bert." prefix), TF-converted LayerNorm names, the tied
  // copies, a buffer, no NSP head and one stray tensor.
  StateDict sd;
  for (const auto& item : source->named_parameters()) {
    std::string name = item.key();
    if (name.rfind("cls.seq_relationship", 0) == 0) continue;
    if (name.rfind("bert.", 0) == 0) name.erase(0, 5);
    if (name == "embeddings.LayerNorm.weight") name = "embeddings.LayerNorm.gamma";
    sd.insert(name, item.value().detach().clone());
  }
  sd.insert("cls.predictions.decoder.weight", source->word_embeddings().detach().clone());
  sd.insert("embeddings.position_ids", torch::arange(16));
  sd.insert("classifier.weight", torch::zeros({3, 16}));
  const InitReport r = load_pretrained(target, sd);
  EXPECT_EQ(r.missing, (std::vector<std::string>{"cls.seq_relationship.weight", "cls.seq_relationship.bias"}));
  EXPECT_EQ(r.unexpected, std::vector<std::string>{"classifier.weight"});
  EXPECT_EQ(r.ignored, (std::vector<std::string>{"cls.predictions.decoder.weight", "embeddings.position_ids"}));
  const auto want = source->named_parameters(), got = target->named_parameters();
  for (const auto& item : want) {
    if (item.key().rfind("cls.seq_relationship", 0) == 0) continue;
    EXPECT_TRUE(torch::equal(got[item.key()], item.value())) << item.key();
  }
  EXPECT_EQ(r.loaded, static_cast<int64_t>(want.size()) - 2);
}

TEST(Pretrained, AnUntiedDecoderIsRefusedNamingBothKeys) {
  BertForPreTraining source(small_config()), target(small_config());
  StateDict sd;
  for (const auto& item : source->named_parameters()) sd.insert(item.key(), item.value().detach().clone());
  // transformers' save_pretrained of a tied model writes no copy; an equal copy is ignored.
  sd.insert("cls.predictions.decoder.bias", source->named_parameters()["cls.predictions.bias"].detach().clone());
  EXPECT_NO_THROW(load_pretrained(target, sd));
  sd.insert("cls.predictions.decoder.weight", source->word_embeddings().detach() + 1);
  try {
    load_pretrained(target, sd);
    ADD_FAILURE() << "an untied decoder weight was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "--init-checkpoint: 'cls.predictions.decoder.weight' differs from "
              "'bert.embeddings.word_embeddings.weight', to which this model ties it (a checkpoint "
              "of an untied model: tie_word_embeddings=false)");
  }
}

TEST(Pretrained, AShapeMismatchNamesTheKey) {
  BertForPreTraining source(small_config(32)), target(small_config(48));
  try {
    load_pretrained(target, source->named_parameters());
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'bert.encoder.layer.0.intermediate.dense.weight' has "
                                         "shape [32, 16] in the checkpoint but [48, 16] in the model"),
              std::string::npos) << e.what();
  }
}

TEST(Pretrained, HuggingFaceStateDictHasTheTiedKeys) {
  BertForPreTraining model(small_config());
  const auto hf = hf_state_dict(model->named_parameters());
  StateDict by_name;
  for (const auto& [name, t] : hf) by_name.insert(name, t);
  ASSERT_TRUE(by_name.contains("cls.predictions.decoder.weight"));
  EXPECT_TRUE(torch::equal(by_name["cls.predictions.decoder.weight"], model->word_embeddings()));
  EXPECT_TRUE(torch::equal(by_name["cls.predictions.decoder.bias"], by_name["cls.predictions.bias"]));
  EXPECT_EQ(hf.size(), model->named_parameters().size() + 2);
  // Written and read back, the export loads into the model it came from.
  const auto dir = scratch("hf").string();
  const auto files = export_hf(dir, model->config(), model->named_parameters(), "", true);
  EXPECT_EQ(files, (std::vector<std::string>{"config.json", "model.safetensors"}));
  std::string kind;
  const auto back = read_init_checkpoint(dir, &kind);
  EXPECT_EQ(kind, "Hugging Face directory (model.safetensors)");
  BertForPreTraining again(small_config());
  const auto r = load_pretrained(again, back);
  EXPECT_TRUE(r.missing.empty() && r.unexpected.empty());
  EXPECT_TRUE(torch::equal(again->word_embeddings(), model->word_embeddings()));
}


// Issue 29: a checkpoint carries what the optimizer does not hold, so that its model.pt is the
// whole state dict: the tied decoder's second names, and buffers and frozen parameters.
TEST(Pretrained, SaveOptionsCarryTheTiedAliasesAndFrozenParameters) {
  BertForPreTraining model(small_config());
  auto options = model_save_options(model);
  EXPECT_EQ(options.aliases, tied_aliases());
  EXPECT_TRUE(options.module_state.empty());  // no buffers, every parameter trains
  const std::string frozen = "bert.embeddings.position_embeddings.weight";
  model->named_parameters()[frozen].set_requires_grad(false);
  options = model_save_options(model);
  ASSERT_EQ(options.module_state.size(), 1u);
  EXPECT_EQ(options.module_state.begin()->first, frozen);
}

TEST(Pretrained, StrictLoadListsMissingAndUnexpectedKeysAndChecksShapesAndTiedCopies) {
  torch::manual_seed(1);
  BertForPreTraining source(small_config());
  torch::manual_seed(2);
  BertForPreTraining target(small_config());
  StateDict full = source->named_parameters();
  for (const auto& [alias, name] : tied_aliases()) {
    const at::Tensor tied = full[name];
    full.insert(alias, tied);
  }
  load_state_dict_strict(target, full);
  for (const auto& item : source->named_parameters()) {
    EXPECT_TRUE(torch::equal(target->named_parameters()[item.key()], item.value())) << item.key();
  }
  auto error = [&](const StateDict& sd) -> std::string {
    try {
      load_state_dict_strict(target, sd);
      return "no error";
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
  };
  StateDict other;  // the example's names only (a model.pt without the aliases), one key short
  for (const auto& item : source->named_parameters()) {
    if (item.key() != "cls.predictions.bias") other.insert(item.key(), item.value());
  }
  other.insert("classifier.weight", torch::zeros({3}));
  EXPECT_NE(error(other).find("missing keys (3): [cls.predictions.bias, cls.predictions.decoder.bias, "
                              "cls.predictions.decoder.weight]; unexpected keys (1): [classifier.weight]"),
            std::string::npos) << error(other);
  StateDict shape = full;
  shape["bert.embeddings.token_type_embeddings.weight"] = torch::zeros({3, 16});
  EXPECT_NE(error(shape).find("'bert.embeddings.token_type_embeddings.weight' has shape [3, 16] in "
                              "the state dict but [2, 16] in the model"), std::string::npos)
      << error(shape);
  StateDict untied = full;
  untied["cls.predictions.decoder.weight"] = torch::zeros_like(full["cls.predictions.decoder.weight"]);
  EXPECT_NE(error(untied).find("'cls.predictions.decoder.weight' is tied to "
                               "'bert.embeddings.word_embeddings.weight' but holds other values"),
            std::string::npos) << error(untied);
}

}  // namespace
}  // namespace bert
