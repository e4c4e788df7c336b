#include "checkpointing.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <mutex>
#include <nlohmann/json.hpp>

#include "shardopt/checkpoint.hpp"
#include "shardopt/error.hpp"
#include "shardopt/grid_checkpoint.hpp"

namespace gpt {

std::string SavedRun::describe() const {
  return fmt::format("--tp {} --pp {} --virtual-stages {}", tp, pp, virtual_stages);
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
  shardopt::save_grid_checkpoint(opt, groups, base, state);
}

std::pair<SavedRun, int64_t> saved_run(const std::string& base) {
  nlohmann::json saved;
  try {
    const std::string first = shardopt::committed_folder(base);
    saved = nlohmann::json::parse(shardopt::read_checkpoint_info(first).trainer_json);
  } catch (const std::exception& e) {
    throw ResumeError(fmt::format("--resume: {}", e.what()));
  }
  return {SavedRun{saved.value("tp", 0), saved.value("pp", 0), saved.value("virtual_stages", 0),
                   saved.value("rows_per_step", int64_t{0}), saved.value("seed", uint64_t{0})},
          saved.value("step", int64_t{0})};
}

int64_t restore(shardopt::DistributedOptimizer& opt, const std::string& base,
                const shardopt::ParallelGroups& groups, const SavedRun& now,
                shardopt::tp::RngTracker& rng) {
  const auto [then, step] = saved_run(base);
  if (then.rows_per_step != now.rows_per_step || then.seed != now.seed) {
    throw ResumeError(fmt::format(
        "--resume: {} read {} rows a step with --seed {}, this run {} with --seed {}: it would "
        "not continue the same data (batch x data-parallel ranks x micro-batches must agree)",
        base, then.rows_per_step, then.seed, now.rows_per_step, now.seed));
  }
  shardopt::TrainerState state;
  try {
    state = shardopt::load_grid_checkpoint(opt, groups, base);
  } catch (const shardopt::Error& e) {  // on every rank alike: a checkpoint that does not fit
    if (e.kind() != shardopt::ErrorKind::Checkpoint && e.kind() != shardopt::ErrorKind::Mismatch) {
      throw;
    }
    throw ResumeError(fmt::format("--resume: {}", e.what()));
  }
  // Dropout's streams continue only where this rank saved them (the same grid and position).
  if (const auto it = state.tensors.find("tp_rng"); it != state.tensors.end()) {
    rng.set_state(it->second);
  }
  if (const auto it = state.tensors.find("rng"); it != state.tensors.end()) {
    auto gen = at::globalContext().defaultGenerator(at::kCPU);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(it->second);
  }
  return step;
}

}  // namespace gpt
