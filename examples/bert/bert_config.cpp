// BertConfig: presets, checks and the config.json formats (see bert_config.hpp).
#include "bert_config.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <stdexcept>

#include "shardopt/estimate.hpp"

namespace bert {

const std::vector<std::string>& supported_activations() {
  static const std::vector<std::string> names = {"gelu", "gelu_new", "gelu_pytorch_tanh", "relu"};
  return names;
}

BertConfig BertConfig::preset(const std::string& name) {
  const auto shape = shardopt::estimate::bert_preset(name);  // throws for unknown names
  BertConfig c;
  c.name = name;
  c.vocab_size = shape.vocab;
  c.hidden_size = shape.hidden;
  c.num_layers = shape.layers;
  c.num_heads = shape.heads;
  c.intermediate_size = shape.intermediate;
  c.max_position_embeddings = shape.max_positions;
  c.type_vocab_size = shape.type_vocab;
  c.nsp = shape.nsp_head;
  // The PyTorch peer baseline (bench/peers/baseline/torch_zero_bert.py) computes MLM logits at
  // every position; every other preset at the masked ones, as Google's BERT.
  c.mlm_all_positions = name == "peer";
  return c;
}

std::vector<std::string> BertConfig::preset_names() {  // the library's table (estimate.hpp)
  std::vector<std::string> names;
  for (const auto& p : shardopt::estimate::kBertPresets) names.push_back(p.name);
  return names;
}

namespace {
constexpr double kMaxSize = 2147483647.0;   // every integer size of a config
constexpr double kMaxParameters = 1099511627776.0;  // 2^40
}  // namespace

void BertConfig::validate() const {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("BertConfig: " + what);
  };
  need(vocab_size > 0, "vocab_size must be > 0");
  // The parameters the config describes, in double (no overflow): below 2^40 (4 TiB of fp32),
  // so that a config cannot make the model's constructor allocate petabytes.
  const double h = static_cast<double>(hidden_size);
  const double params =
      h * static_cast<double>(vocab_size + max_position_embeddings + type_vocab_size) +
      static_cast<double>(num_layers) * (4 * h * h + 2 * h * static_cast<double>(intermediate_size));
  need(params < kMaxParameters,
       fmt::format("the sizes describe {:.3g} parameters, more than the limit of {:.3g}", params,
                   kMaxParameters));
  need(hidden_size > 0 && num_heads > 0 && hidden_size % num_heads == 0,
       fmt::format("hidden_size ({}) must be a multiple of num_attention_heads ({})", hidden_size,
                   num_heads));
  need(num_layers > 0 && intermediate_size > 0,
       "num_hidden_layers and intermediate_size must be > 0");
  need(max_position_embeddings > 0 && type_vocab_size > 0,
       "max_position_embeddings and type_vocab_size must be > 0");
  need(hidden_dropout >= 0 && hidden_dropout < 1 && attention_dropout >= 0 &&
           attention_dropout < 1,
       "dropout probabilities must be in [0, 1)");
  need(layer_norm_eps > 0 && initializer_range > 0, "layer_norm_eps and initializer_range must be > 0");
  need(attn_implementation == "auto" || attn_implementation == "eager" ||
           attn_implementation == "sdpa",
       fmt::format("attn_implementation '{}' is not supported (auto, eager, sdpa)",
                   attn_implementation));
  const auto& acts = supported_activations();
  need(std::find(acts.begin(), acts.end(), hidden_act) != acts.end(),
       fmt::format("hidden_act '{}' is not supported (supported: {})", hidden_act,
                   fmt::join(acts, ", ")));
}

namespace {

// Keys that describe the pretraining model; what else a config holds is ignored and reported.
const std::set<std::string> kModelKeys = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
    "type_vocab_size", "initializer_range", "layer_norm_eps", "position_embedding_type",
    "model_type", "architectures", "is_decoder", "add_cross_attention", "tie_word_embeddings"};

std::string shown(const nlohmann::json& v) { return v.dump(); }

}  // namespace

BertConfig BertConfig::from_json(const nlohmann::json& j, const std::string& source,
                                 std::vector<std::string>* ignored) {
  auto fail = [&](const std::string& key, const std::string& what) -> std::invalid_argument {
    return std::invalid_argument(fmt::format("{}: '{}' {}", source, key, what));
  };
  if (!j.is_object()) {
    throw std::invalid_argument(fmt::format("{}: expected a JSON object (bert_config.json or "
                                            "config.json), got {}", source, j.type_name()));
  }
  auto integer = [&](const char* key, bool required, int64_t fallback) -> int64_t {
    if (!j.contains(key)) {
      if (required) throw fail(key, "is missing (a BERT config names the model's shape)");
      return fallback;
    }
    const auto& v = j.at(key);
    const bool whole = v.is_number_integer() || (v.is_number_float() && std::isfinite(v.get<double>()) &&
                                                 std::floor(v.get<double>()) == v.get<double>());
    // Bounded before the cast (a double past int64 is undefined behaviour) and so that no config
    // can ask for a model larger than any machine: each size below 2^31, as in HF's configs.
    if (!whole || v.get<double>() < 1 || v.get<double>() > kMaxSize) {
      throw fail(key, fmt::format("expected an integer in [1, {}], got {}", kMaxSize, shown(v)));
    }
    return static_cast<int64_t>(v.get<double>());
  };
  auto real = [&](const char* key, double fallback, double lo, double hi, bool open_lo) -> double {
    if (!j.contains(key)) return fallback;
    const auto& v = j.at(key);
    const double x = v.is_number() ? v.get<double>() : NAN;
    if (!v.is_number() || !std::isfinite(x) || (open_lo ? x <= lo : x < lo) || x >= hi) {
      throw fail(key, fmt::format("expected a number in {}{}, {}), got {}", open_lo ? "(" : "[", lo,
                                  hi, shown(v)));
    }
    return x;
  };
  BertConfig c;
  c.name = source;
  c.vocab_size = integer("vocab_size", true, 0);
  c.hidden_size = integer("hidden_size", true, 0);
  c.num_layers = integer("num_hidden_layers", true, 0);
  c.num_heads = integer("num_attention_heads", true, 0);
  c.intermediate_size = integer("intermediate_size", true, 0);
  c.max_position_embeddings = integer("max_position_embeddings", false, 512);
  c.type_vocab_size = integer("type_vocab_size", false, 2);
  c.hidden_dropout = real("hidden_dropout_prob", 0.1, 0, 1, false);
  c.attention_dropout = real("attention_probs_dropout_prob", 0.1, 0, 1, false);
  c.initializer_range = real("initializer_range", 0.02, 0, HUGE_VAL, true);
  c.layer_norm_eps = real("layer_norm_eps", 1e-12, 0, 1, true);
  if (j.contains("hidden_act")) {
    const auto& v = j.at("hidden_act");
    const auto& acts = supported_activations();
    if (!v.is_string() || std::find(acts.begin(), acts.end(), v.get<std::string>()) == acts.end()) {
      throw fail("hidden_act", fmt::format("{} is not supported (supported: {})", shown(v),
                                           fmt::join(acts, ", ")));
    }
    c.hidden_act = v.get<std::string>();
  }
  if (j.contains("position_embedding_type") && j.at("position_embedding_type") != "absolute") {
    throw fail("position_embedding_type",
               shown(j.at("position_embedding_type")) + " is not supported (only \"absolute\")");
  }
  if (j.contains("model_type") && j.at("model_type") != "bert") {
    throw fail("model_type", shown(j.at("model_type")) + " is not BERT (expected \"bert\")");
  }
  for (const char* key : {"is_decoder", "add_cross_attention"}) {
    if (!j.contains(key)) continue;
    // Not j.value(key, false): it throws nlohmann's type_error for 1 or "no" (issue 42).
    const auto& v = j.at(key);
    if (!v.is_boolean()) throw fail(key, fmt::format("expected true or false, got {}", shown(v)));
    if (v.get<bool>()) throw fail(key, "true is not supported (an encoder only)");
  }
  // transformers' save_pretrained writes it; false would give the MLM decoder its own matrix.
  if (j.contains("tie_word_embeddings") && j.at("tie_word_embeddings") != true) {
    throw fail("tie_word_embeddings", shown(j.at("tie_word_embeddings")) +
                                          " is not supported (this BERT's MLM decoder is always "
                                          "the word embedding matrix)");
  }
  // A config exported without the NSP head (BertForMaskedLM) has no pooler either.
  if (j.contains("architectures") && j.at("architectures") == nlohmann::json::array({"BertForMaskedLM"})) {
    c.nsp = false;
  }
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    std::string why = e.what();
    if (why.rfind("BertConfig: ", 0) == 0) why.erase(0, 12);
    throw std::invalid_argument(fmt::format("{}: {}", source, why));
  }
  if (ignored) {
    for (const auto& item : j.items()) {
      if (!kModelKeys.count(item.key())) ignored->push_back(item.key());
    }
  }
  return c;
}

BertConfig BertConfig::load(const std::string& path, std::vector<std::string>* ignored) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument(fmt::format("{}: cannot read the file", path));
  const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw std::invalid_argument(fmt::format("{}: not valid JSON", path));
  return from_json(j, path, ignored);
}

nlohmann::json BertConfig::to_hf_json() const {
  return {{"architectures", {nsp ? "BertForPreTraining" : "BertForMaskedLM"}},
          {"model_type", "bert"},
          {"vocab_size", vocab_size},
          {"hidden_size", hidden_size},
          {"num_hidden_layers", num_layers},
          {"num_attention_heads", num_heads},
          {"intermediate_size", intermediate_size},
          {"hidden_act", hidden_act},
          {"hidden_dropout_prob", hidden_dropout},
          {"attention_probs_dropout_prob", attention_dropout},
          {"max_position_embeddings", max_position_embeddings},
          {"type_vocab_size", type_vocab_size},
          {"initializer_range", initializer_range},
          {"layer_norm_eps", layer_norm_eps},
          {"position_embedding_type", "absolute"},
          {"pad_token_id", 0},
          {"tie_word_embeddings", true},
          {"torch_dtype", "float32"}};
}

}  // namespace bert
