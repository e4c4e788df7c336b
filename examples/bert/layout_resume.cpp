// Checkpoints across tensor- and pipeline-parallel layouts (see layout_resume.hpp).
#include "layout_resume.hpp"

#include <torch/torch.h>

#include <fmt/format.h>

#include <regex>
#include <string>
#include <vector>

namespace bert {

std::string SavedLayout::describe() const {
  return fmt::format("--tp {} --pp {}{}", tp, pp,
                     virtual_stages > 1 ? fmt::format(" --virtual-stages {}", virtual_stages) : "");
}

SavedLayout layout_of(const Run& r) { return {r.tp(), r.pp(), r.pp() > 1 ? r.a.virtual_stages : 1}; }

nlohmann::json layout_json(const Run& r) {
  if (r.tp() == 1 && r.pp() == 1) return nullptr;
  nlohmann::json splits = nlohmann::json::object();
  for (const auto& [name, s] : r.model->splits()) {
    splits[name] = {{"dim", s.dim}, {"full", s.full}, {"padded", s.padded}};
  }
  const SavedLayout l = layout_of(r);
  return {{"tp", l.tp}, {"pp", l.pp}, {"virtual_stages", l.virtual_stages},
          {"dp", r.dp->size()}, {"splits", splits}};
}

namespace {

namespace fs = std::filesystem;

// N of the folder `prefix`0-of-N under `dir`, or 0 when there is none.
int parts_in(const fs::path& dir, const std::string& prefix) {
  std::error_code ec;
  const std::regex part(prefix + "0-of-([0-9]+)");
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (std::regex_match(name, m, part)) return std::stoi(m[1]);
  }
  return 0;
}

nlohmann::json trainer_json(const fs::path& dir) {
  return nlohmann::json::parse(shardopt::read_checkpoint_info(dir.string()).trainer_json);
}

// The unsplit tensor from each old tensor rank's part (`split` null: replicated, part 0's).
at::Tensor join(const std::vector<at::Tensor>& parts, const nlohmann::json& split) {
  if (split.is_null()) return parts.at(0);
  const int64_t dim = split.at("dim").get<int64_t>(), full = split.at("full").get<int64_t>();
  return torch::cat(parts, dim).narrow(dim, 0, full);
}

}  // namespace

SavedLayout saved_layout(const fs::path& base) {
  std::error_code ec;
  SavedLayout l;
  fs::path stage = base;
  if (!fs::exists(base / "manifest.json", ec) && (l.pp = parts_in(base, "pp")) > 0) {
    stage = base / fmt::format("pp0-of-{}", l.pp);
  }
  l.pp = std::max(l.pp, 1);
  if (!fs::exists(stage / "manifest.json", ec)) {
    l.tp = parts_in(stage, "tp");
    if (l.tp == 0) {
      throw UsageError(fmt::format(
          "--resume: {} holds no checkpoint (neither manifest.json nor the tp0-of-T or pp0-of-P "
          "folder of a tensor- or pipeline-parallel run)", stage.string()));
    }
  }
  if (l.pp > 1) {
    const auto layout = trainer_json(checkpoint_path(base, 0, l.tp, 0, l.pp)).value("layout", nlohmann::json());
    l.virtual_stages = layout.is_object() ? layout.value("virtual_stages", 1) : 1;
  }
  return l;
}

shardopt::TrainerState load_checkpoint_any_layout(Run& r, const fs::path& base,
                                                  const SavedLayout& saved) {
  const auto held = [&](const std::string& name) { return !r.pipeline || r.pipeline->holds(name); };
  shardopt::FullState state;
  std::string first_trainer, first_folder;
  int64_t first_step = -1;
  for (int stage = 0; stage < saved.pp; ++stage) {
    const fs::path stage0 = checkpoint_path(base, 0, saved.tp, stage, saved.pp);
    const auto info = shardopt::read_checkpoint_info(stage0.string());
    const auto trainer = nlohmann::json::parse(info.trainer_json);
    const int64_t step = trainer.value("step", int64_t{-1});
    if (stage == 0) {
      first_trainer = info.trainer_json;
      first_folder = stage0.string();
      first_step = step;
    } else if (step != first_step) {
      throw UsageError(fmt::format(
          "--resume: {} is at step {} but {} at step {}: a save was cut off between the two "
          "(each stage's folder is replaced on its own); no consistent checkpoint is left",
          first_folder, first_step, stage0.string(), step));
    }
    const nlohmann::json splits = trainer.contains("layout") ? trainer["layout"].at("splits")
                                                             : nlohmann::json::object();
    if (saved.tp > 1 && splits.empty()) {
      throw UsageError(fmt::format("--resume: {} was written at --tp {} but records no splits",
                                   stage0.string(), saved.tp));
    }
    std::vector<shardopt::FullState> parts;
    for (int k = 0; k < saved.tp; ++k) {
      parts.push_back(shardopt::read_full_state(
          checkpoint_path(base, k, saved.tp, stage, saved.pp).string(), /*with_optimizer_state=*/true));
    }
    if (stage == 0) {
      state.step = parts[0].step;
      state.rule = parts[0].rule;
      state.hyperparameters_json = parts[0].hyperparameters_json;
    }
    // This rank's slice of a tensor joined from every old tensor rank's part.
    auto mine = [&](const std::string& name, auto&& part_of) {
      std::vector<at::Tensor> pieces;
      for (auto& p : parts) pieces.push_back(part_of(p));
      try {
        return r.model->slice_of(name, join(pieces, splits.contains(name) ? splits[name] : nlohmann::json()));
      } catch (const std::exception& e) {
        throw UsageError(fmt::format("--resume: {} (checkpoint {} at {})", e.what(),
                                     base.string(), saved.describe()));
      }
    };
    // The first stage folder holding a parameter gives it (the tied word embedding is in the
    // first and the last stage's, with equal values and state).
    for (const auto& p : parts[0].params) {
      if (!held(p.key()) || state.params.contains(p.key())) continue;
      state.params.insert(p.key(), mine(p.key(), [&](shardopt::FullState& f) { return f.params[p.key()]; }));
      for (const auto& [state_name, tensors] : parts[0].optimizer_state) {
        if (!tensors.contains(p.key())) continue;
        state.optimizer_state[state_name].insert(p.key(), mine(p.key(), [&](shardopt::FullState& f) {
          return f.optimizer_state.at(state_name)[p.key()];
        }));
      }
    }
  }
  shardopt::load_full_state(*r.opt, state);
  return {first_trainer, {}};
}

}  // namespace bert
