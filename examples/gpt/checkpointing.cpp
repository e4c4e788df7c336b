#include "checkpointing.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>

#include "shardopt/checkpoint.hpp"

namespace gpt {
namespace fs = std::filesystem;

std::string SavedRun::describe() const {
  return fmt::format("--tp {} --pp {} --virtual-stages {}", tp, pp, virtual_stages);
}

std::string checkpoint_folder(const std::string& base, const shardopt::ParallelGroups& groups) {
  const auto& l = groups.layout;
  if (l.tp == 1 && l.pp == 1) return base;
  return (fs::path(base) / fmt::format("pp{}-of-{}", groups.pp_rank, l.pp) /
          fmt::format("tp{}-of-{}", groups.tp_rank, l.tp))
      .string();
}

void save(shardopt::DistributedOptimizer& opt, const std::string& base,
          const shardopt::ParallelGroups& groups, const SavedRun& run, int64_t step,
          const shardopt::tp::RngTracker& rng) {
  const nlohmann::json json = {{"step", step},
                               {"tp", run.tp},
                               {"pp", run.pp},
                               {"virtual_stages", run.virtual_stages},
                               {"rows_per_step", run.rows_per_step},
                               {"seed", run.seed}};
  shardopt::TrainerState state;
  state.json = json.dump();
  auto gen = at::globalContext().defaultGenerator(at::kCPU);
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    state.tensors["rng"] = gen.get_state();  // dropout's stream outside the split regions
  }
  state.tensors["tp_rng"] = rng.state();  // inside them: this rank's heads
  shardopt::save_checkpoint(opt, checkpoint_folder(base, groups), state);
}

int64_t restore(shardopt::DistributedOptimizer& opt, const std::string& base,
                const shardopt::ParallelGroups& groups, const SavedRun& now,
                shardopt::tp::RngTracker& rng) {
  const std::string own = checkpoint_folder(base, groups);
  std::error_code ec;
  if (!fs::is_regular_file(fs::path(own) / "manifest.json", ec)) {
    throw ResumeError(
        fmt::format("--resume: no checkpoint of this layout ({}) in {}: loading a "
                    "checkpoint written at another (t, p, V) is not supported yet",
                    now.describe(), base));
  }
  const auto saved = nlohmann::json::parse(shardopt::read_checkpoint_info(own).trainer_json);
  SavedRun then{saved.value("tp", 0), saved.value("pp", 0), saved.value("virtual_stages", 0),
                saved.value("rows_per_step", int64_t{0}), saved.value("seed", uint64_t{0})};
  if (then.tp != now.tp || then.pp != now.pp || then.virtual_stages != now.virtual_stages) {
    throw ResumeError(
        fmt::format("--resume: {} was written at {}, this run is {}: loading across "
                    "layouts is not supported yet",
                    base, then.describe(), now.describe()));
  }
  if (then.rows_per_step != now.rows_per_step || then.seed != now.seed) {
    throw ResumeError(
        fmt::format("--resume: {} read {} rows a step with --seed {}, this run {} "
                    "with --seed {}: it would not continue the same data",
                    base, then.rows_per_step, then.seed, now.rows_per_step, now.seed));
  }
  const shardopt::TrainerState state = shardopt::load_checkpoint(opt, own);
  if (const auto it = state.tensors.find("tp_rng"); it != state.tensors.end()) {
    rng.set_state(it->second);
  }
  if (const auto it = state.tensors.find("rng"); it != state.tensors.end()) {
    auto gen = at::globalContext().defaultGenerator(at::kCPU);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(it->second);
  }
  return saved.value("step", int64_t{0});
}

}  // namespace gpt
