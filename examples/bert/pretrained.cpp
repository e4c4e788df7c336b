// --init-checkpoint and --export-hf (see pretrained.hpp).
#include "pretrained.hpp"

#include <torch/torch.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "shardopt/safetensors.hpp"
#include "shardopt/checkpoint.hpp"
#include "shardopt/hf_export.hpp"
#include "shardopt/parallel_layout.hpp"

namespace bert {
namespace fs = std::filesystem;
namespace safetensors = shardopt::safetensors;

namespace {

const std::map<std::string, at::ScalarType>& dtypes() {
  static const std::map<std::string, at::ScalarType> m = {
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf}, {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool}};
  return m;
}

std::string dtype_name(at::ScalarType t) {
  for (const auto& [name, type] : dtypes()) {
    if (type == t) return name;
  }
  throw std::invalid_argument(fmt::format("safetensors: no dtype name for {}", c10::toString(t)));
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// transformers' renaming of old checkpoints, and BertModel's names under "bert.".
std::string normalise(std::string name) {
  if (name.rfind("module.", 0) == 0) name.erase(0, 7);
  for (const char* top : {"embeddings.", "encoder.", "pooler."}) {
    if (name.rfind(top, 0) == 0) name = "bert." + name;
  }
  if (ends_with(name, "LayerNorm.gamma")) name.replace(name.size() - 5, 5, "weight");
  if (ends_with(name, "LayerNorm.beta")) name.replace(name.size() - 4, 4, "bias");
  return name;
}

std::string shape_text(at::IntArrayRef s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

}  // namespace

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<at::Tensor> keep;  // contiguous CPU copies live until written
  std::vector<std::pair<std::string, safetensors::TensorView>> views;
  for (const auto& [name, t] : tensors) {
    keep.push_back(t.detach().to(at::kCPU).contiguous());
    const auto& c = keep.back();
    views.push_back({name, {dtype_name(c.scalar_type()), c.sizes().vec(), c.data_ptr()}});
  }
  safetensors::write(path, views);
}

StateDict read_safetensors(const std::string& path) {
  const auto file = safetensors::read(path);
  StateDict out;
  for (const auto& e : file.entries) {
    const auto type = dtypes().at(e.dtype);
    auto t = torch::empty(e.shape, torch::TensorOptions().dtype(type));
    // An empty tensor has no storage (data_ptr() is null): memcpy(nullptr, .., 0) is undefined
    // (UBSan, issue 42).
    if (e.nbytes > 0) std::memcpy(t.data_ptr(), file.bytes(e), e.nbytes);
    out.insert(e.name, t);
  }
  return out;
}

namespace {

// A sharded Hugging Face directory: every file the index names, each tensor where it says.
StateDict read_sharded_safetensors(const std::string& dir) {
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  std::ifstream in(index_path);
  const auto index = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    throw std::invalid_argument(fmt::format("{}: no weight_map object", index_path.string()));
  }
  std::map<std::string, std::string> where;
  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string()) throw std::invalid_argument(fmt::format("{}: '{}' names no file", index_path.string(), name));
    where[name] = file.get<std::string>();
    files.insert(file.get<std::string>());
  }
  StateDict out;
  for (const auto& file : files) {
    if (file.find('/') != std::string::npos || file == "..") {
      throw std::invalid_argument(fmt::format("{}: '{}' is not a file of the directory", index_path.string(), file));
    }
    for (const auto& item : read_safetensors((fs::path(dir) / file).string())) {
      const auto it = where.find(item.key());
      if (it == where.end() || it->second != file) {
        throw std::invalid_argument(fmt::format("{}: '{}' is in {} but the index says {}", dir, item.key(),
                                                file, it == where.end() ? "nothing" : it->second));
      }
      out.insert(item.key(), item.value());
    }
  }
  for (const auto& [name, file] : where) {
    if (!out.contains(name)) throw std::invalid_argument(fmt::format("{}: '{}' is not in {}", dir, name, file));
  }
  return out;
}

}  // namespace

StateDict read_init_checkpoint(const std::string& path, std::string* kind) {
  std::error_code ec;
  auto say = [&](const std::string& k) {
    if (kind) *kind = k;
  };
  try {
    if (fs::is_directory(path, ec)) {
      if (fs::is_regular_file(fs::path(path) / "model.safetensors", ec)) {
        say("Hugging Face directory (model.safetensors)");
        return read_safetensors((fs::path(path) / "model.safetensors").string());
      }
      if (fs::is_regular_file(fs::path(path) / "model.safetensors.index.json", ec)) {
        say("Hugging Face directory (model.safetensors.index.json)");
        return read_sharded_safetensors(path);
      }
      // A checkpoint folder, or a grid's base of one folder (commit.json: --tp 1 --pp 1).
      if (fs::is_regular_file(fs::path(path) / "manifest.json", ec) ||
          fs::is_regular_file(fs::path(path) / "commit.json", ec)) {
        say("shardopt checkpoint (fp32 master parameters)");
        return shardopt::read_full_state(path).params;
      }
      throw std::invalid_argument("a directory with neither model.safetensors(.index.json) nor a "
                                  "shardopt checkpoint (manifest.json or commit.json)");
    }
    if (!fs::is_regular_file(path, ec)) throw std::invalid_argument("no such file or directory");
    if (ends_with(path, ".safetensors") || safetensors::looks_like(path)) {
      say("safetensors");
      return read_safetensors(path);
    }
    say("torch.save state dict");
    return shardopt::read_state_dict(path);
  } catch (const std::exception& e) {
    std::string why = e.what();
    throw std::invalid_argument(fmt::format("--init-checkpoint: '{}': {}", path,
                                            why.substr(0, why.find('\n'))));
  }
}

InitReport load_pretrained(BertForPreTraining& model, const StateDict& state) {
  std::map<std::string, at::Tensor> by_name;
  std::map<std::string, at::Tensor> tied_copies;  // normalised alias -> tensor
  InitReport r;
  for (const auto& item : state) {
    const std::string name = normalise(item.key());
    // Tied copies (the decoder is the word embedding matrix, its bias cls.predictions.bias) and
    // buffers are not parameters of this model.
    if (tied_aliases().count(name) > 0 || ends_with(name, "embeddings.position_ids") ||
        ends_with(name, "embeddings.token_type_ids")) {
      if (tied_aliases().count(name) > 0) tied_copies[name] = item.value();
      r.ignored.push_back(item.key());
      continue;
    }
    by_name[name] = item.value();
  }
  // A tied copy that differs from what it is tied to comes from an untied model (transformers'
  // tie_word_embeddings=false): this model cannot hold both, so it refuses rather than drop one.
  for (const auto& [alias, t] : tied_copies) {
    const std::string& source = tied_aliases().at(alias);
    const auto it = by_name.find(source);
    if (it != by_name.end() && (it->second.sizes() != t.sizes() || !torch::equal(it->second, t.to(it->second.dtype())))) {
      throw std::invalid_argument(fmt::format(
          "--init-checkpoint: '{}' differs from '{}', to which this model ties it (a checkpoint "
          "of an untied model: tie_word_embeddings=false)", alias, source));
    }
  }
  torch::NoGradGuard no_grad;
  for (auto& p : model->named_parameters()) {
    const auto it = by_name.find(p.key());
    if (it == by_name.end()) {
      r.missing.push_back(p.key());
      continue;
    }
    if (it->second.sizes() != p.value().sizes()) {
      throw std::invalid_argument(fmt::format(
          "--init-checkpoint: '{}' has shape {} in the checkpoint but {} in the model (is the "
          "config the checkpoint's? --bert-config)", p.key(), shape_text(it->second.sizes()),
          shape_text(p.value().sizes())));
    }
    p.value().copy_(it->second.to(p.value().dtype()));
    ++r.loaded;
    by_name.erase(it);
  }
  for (const auto& [name, t] : by_name) r.unexpected.push_back(name);
  return r;
}

shardopt::SaveOptions model_save_options(BertForPreTraining& model) {
  const auto params = model->named_parameters();
  shardopt::SaveOptions options = shardopt::module_save_options(params, model->named_buffers());
  for (const auto& [alias, name] : tied_aliases()) {
    if (params.contains(name)) options.aliases[alias] = name;
  }
  return options;
}

void load_state_dict_strict(BertForPreTraining& model, const StateDict& state) {
  StateDict own = model->named_parameters();
  for (const auto& item : model->named_buffers()) own.insert(item.key(), item.value());
  std::vector<std::string> missing, unexpected;
  for (const auto& item : own) {
    if (!state.contains(item.key())) missing.push_back(item.key());
  }
  for (const auto& [alias, name] : tied_aliases()) {
    if (!state.contains(alias)) missing.push_back(alias);
  }
  for (const auto& item : state) {
    if (!own.contains(item.key()) && tied_aliases().count(item.key()) == 0) {
      unexpected.push_back(item.key());
    }
  }
  if (!missing.empty() || !unexpected.empty()) {
    throw std::invalid_argument(fmt::format(
        "load_state_dict (strict): missing keys ({}): [{}]; unexpected keys ({}): [{}]",
        missing.size(), fmt::join(missing, ", "), unexpected.size(), fmt::join(unexpected, ", ")));
  }
  for (const auto& item : own) {
    const at::Tensor& t = state[item.key()];
    if (t.sizes() != item.value().sizes()) {
      throw std::invalid_argument(fmt::format("load_state_dict (strict): '{}' has shape {} in the "
                                              "state dict but {} in the model", item.key(),
                                              shape_text(t.sizes()), shape_text(item.value().sizes())));
    }
  }
  for (const auto& [alias, name] : tied_aliases()) {
    if (!torch::equal(state[alias], state[name])) {
      throw std::invalid_argument(fmt::format("load_state_dict (strict): '{}' is tied to '{}' but "
                                              "holds other values", alias, name));
    }
  }
  torch::NoGradGuard no_grad;
  for (auto& item : own) item.value().copy_(state[item.key()]);
}

void print_init_report(const std::string& path, const std::string& kind, const InitReport& r) {
  fmt::print("[bert] init checkpoint: {} ({}): {} parameters loaded\n", path, kind, r.loaded);
  auto list = [](const char* what, const std::vector<std::string>& names) {
    if (!names.empty()) fmt::print("[bert] init checkpoint: {} ({}): {}\n", what, names.size(),
                                   fmt::join(names, ", "));
  };
  list("missing, initialised as usual", r.missing);
  list("unexpected, not used", r.unexpected);
  list("ignored (tied copies, buffers)", r.ignored);
}

std::map<std::string, std::vector<std::string>> hf_names() {
  std::map<std::string, std::vector<std::string>> names;
  // Note [Tied MLM decoder] (model.hpp): transformers' state dict names both tied tensors.
  for (const auto& [alias, source] : tied_aliases()) {
    if (names.count(source) == 0) names[source] = {source};
    names[source].push_back(alias);
  }
  return names;
}

std::vector<std::pair<std::string, at::Tensor>> hf_state_dict(const StateDict& params) {
  const auto names = hf_names();
  for (const auto& [source, out] : names) {
    if (!params.contains(source)) throw std::invalid_argument("export: the parameters lack " + source);
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : params) {
    const auto fp32 = item.value().detach().to(at::kCPU, at::kFloat).contiguous();
    const auto it = names.find(item.key());
    if (it == names.end()) {
      out.emplace_back(item.key(), fp32);
      continue;
    }
    for (const auto& name : it->second) out.emplace_back(name, fp32.clone());
  }
  return out;
}

shardopt::HfExportOptions hf_export_options(const BertConfig& config, const std::string& vocab_path,
                                            bool lower_case, std::vector<std::string>* extra_files) {
  shardopt::HfExportOptions o;
  o.names = hf_names();
  o.write_extra = [config, vocab_path, lower_case, extra_files](const std::string& dir) {
    const fs::path d(dir);
    auto json_file = [&](const char* name, const nlohmann::json& j) {
      std::ofstream out(d / name);
      out << j.dump(2) << '\n';
      if (!out) throw std::runtime_error(fmt::format("cannot write {}", (d / name).string()));
      if (extra_files) extra_files->push_back(name);
    };
    json_file("config.json", config.to_hf_json());
    if (vocab_path.empty()) return;
    fs::copy_file(vocab_path, d / "vocab.txt", fs::copy_options::overwrite_existing);
    if (extra_files) extra_files->push_back("vocab.txt");
    json_file("tokenizer_config.json",
              {{"tokenizer_class", "BertTokenizer"}, {"do_lower_case", lower_case},
               {"strip_accents", nullptr}, {"tokenize_chinese_chars", true},
               {"model_max_length", config.max_position_embeddings},
               {"unk_token", "[UNK]"}, {"sep_token", "[SEP]"}, {"pad_token", "[PAD]"},
               {"cls_token", "[CLS]"}, {"mask_token", "[MASK]"}});
    json_file("special_tokens_map.json",
              {{"unk_token", "[UNK]"}, {"sep_token", "[SEP]"}, {"pad_token", "[PAD]"},
               {"cls_token", "[CLS]"}, {"mask_token", "[MASK]"}});
  };
  return o;
}

std::vector<std::string> export_hf(const std::string& dir, const BertConfig& config,
                                   const StateDict& params, const std::string& vocab_path,
                                   bool lower_case) {
  // The one writer of exports (shardopt/hf_export.hpp), on a grid of one process.
  std::vector<std::string> files;
  const auto groups = shardopt::make_parallel_groups(shardopt::make_single_communicator(), {});
  const auto report = shardopt::export_hf_safetensors(
      dir, params, groups, nullptr, hf_export_options(config, vocab_path, lower_case, &files));
  files.insert(files.end(), report.files.begin(), report.files.end());
  return files;
}

}  // namespace bert
