// Checkpoints across tensor-parallel layouts (see tp_resume.hpp).
#include "tp_resume.hpp"

#include <torch/torch.h>

#include <fmt/format.h>

#include <map>
#include <regex>
#include <string>
#include <vector>

namespace bert {

nlohmann::json layout_json(const Run& r) {
  if (r.tp() == 1) return nullptr;
  nlohmann::json splits = nlohmann::json::object();
  for (const auto& [name, s] : r.model->splits()) {
    splits[name] = {{"dim", s.dim}, {"full", s.full}, {"padded", s.padded}};
  }
  return {{"tp", r.tp()}, {"dp", r.dp->size()}, {"splits", splits}};
}

int saved_tensor_parallel(const std::filesystem::path& base) {
  std::error_code ec;
  if (std::filesystem::exists(base / "manifest.json", ec)) return 1;
  static const std::regex part(R"(tp0-of-([0-9]+))");
  for (const auto& entry : std::filesystem::directory_iterator(base, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (std::regex_match(name, m, part)) return std::stoi(m[1]);
  }
  throw UsageError(fmt::format("--resume: {} holds no checkpoint (neither manifest.json nor the "
                               "tp0-of-T folder of a tensor-parallel run)", base.string()));
}

namespace {

// The unsplit tensor from each old tensor rank's part (`split` null: replicated, part 0's).
at::Tensor join(const std::vector<at::Tensor>& parts, const nlohmann::json& split) {
  if (split.is_null()) return parts.at(0);
  const int64_t dim = split.at("dim").get<int64_t>(), full = split.at("full").get<int64_t>();
  return torch::cat(parts, dim).narrow(dim, 0, full);
}

}  // namespace

shardopt::TrainerState load_checkpoint_any_layout(Run& r, const std::filesystem::path& base,
                                                  int saved_tp) {
  std::vector<shardopt::FullState> parts;
  for (int k = 0; k < saved_tp; ++k) {
    parts.push_back(shardopt::read_full_state(checkpoint_path(base, k, saved_tp).string(),
                                              /*with_optimizer_state=*/true));
  }
  const auto info = shardopt::read_checkpoint_info(checkpoint_path(base, 0, saved_tp).string());
  const auto trainer = nlohmann::json::parse(info.trainer_json);
  const nlohmann::json splits =
      trainer.contains("layout") ? trainer["layout"].at("splits") : nlohmann::json::object();
  if (saved_tp > 1 && splits.empty()) {
    throw UsageError(fmt::format("--resume: {} was written at --tp {} but records no splits",
                                 base.string(), saved_tp));
  }
  auto split_of = [&](const std::string& name) {
    return splits.contains(name) ? splits[name] : nlohmann::json();
  };
  // This rank's slice of a tensor joined from every old part.
  auto mine = [&](const std::string& name, auto&& part_of) {
    std::vector<at::Tensor> pieces;
    for (auto& p : parts) pieces.push_back(part_of(p));
    try {
      return r.model->slice_of(name, join(pieces, split_of(name)));
    } catch (const std::exception& e) {
      throw UsageError(fmt::format("--resume: {} (checkpoint {} at --tp {})", e.what(),
                                   base.string(), saved_tp));
    }
  };
  shardopt::FullState state;
  state.step = parts[0].step;
  state.rule = parts[0].rule;
  state.hyperparameters_json = parts[0].hyperparameters_json;
  for (const auto& p : parts[0].params) {
    state.params.insert(p.key(), mine(p.key(), [&](shardopt::FullState& f) { return f.params[p.key()]; }));
  }
  for (const auto& [state_name, tensors] : parts[0].optimizer_state) {
    auto& out = state.optimizer_state[state_name];
    for (const auto& t : tensors) {
      out.insert(t.key(), mine(t.key(), [&](shardopt::FullState& f) {
                   return f.optimizer_state.at(state_name)[t.key()];
                 }));
    }
  }
  parts.clear();
  shardopt::load_full_state(*r.opt, state);
  return {info.trainer_json, {}};
}

}  // namespace bert
