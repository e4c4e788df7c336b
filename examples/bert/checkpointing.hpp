// The trainer's side of --checkpoint-every / --resume: what besides the optimizer a run needs to
// continue the same trajectory (step, data-loader position, LR schedule inputs, losses so far,
// and every rank's torch CPU generator, which drives dropout), stored in shardopt's atomic
// checkpoint as TrainerState. Header-only; included by run.hpp.
#pragma once

#include <ATen/CPUGeneratorImpl.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "options.hpp"
#include "shardopt/checkpoint.hpp"
#include "shardopt/snapshot.hpp"

namespace bert {

struct RunState {
  int64_t step = 0;           // optimizer steps completed
  int64_t data_position = 0;  // next global batch index of the BatchLoader
  int64_t rows_per_position = 0;  // rows one data position covers: --batch-size x data-parallel ranks
  std::vector<double> losses;
  double train_s = 0;
  int64_t tokens = 0;
};

inline at::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

inline void set_cpu_rng_state(const at::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// --snapshot-dir (default /dev/shm/shardopt-<hash of the absolute OUT>, one job per OUT), with
// `{host}` replaced by this rank's host number (rank / --ranks-per-host) to emulate hosts on one
// machine; --ranks-per-host.
inline shardopt::SnapshotOptions snapshot_options(const Args& a, int rank) {
  std::string dir = a.snapshot_dir;
  if (dir.empty()) {
    const std::string out = std::filesystem::absolute(a.out).lexically_normal().string();
    dir = "/dev/shm/shardopt-" + std::to_string(std::hash<std::string>{}(out) % 1000000007u);
  }
  if (const auto at = dir.find("{host}"); at != std::string::npos) {
    if (a.ranks_per_host <= 0) {
      throw std::invalid_argument("--snapshot-dir " + a.snapshot_dir +
                                  ": {host} needs --ranks-per-host");
    }
    dir.replace(at, 6, std::to_string(rank / a.ranks_per_host));
  }
  return {dir, a.ranks_per_host};
}

// The tensor- and pipeline-parallel layout a checkpoint was written at: the grid from its commit
// record (shardopt/grid_checkpoint.hpp), V from the trainer state.
struct SavedLayout {
  int tp = 1, pp = 1, virtual_stages = 1;
  bool same_folders(const SavedLayout& o) const { return tp == o.tp && pp == o.pp; }
  bool operator==(const SavedLayout& o) const {
    return same_folders(o) && virtual_stages == o.virtual_stages;
  }
  // "--tp 2 --pp 2", plus " --virtual-stages V" when V > 1
  std::string describe() const {
    return "--tp " + std::to_string(tp) + " --pp " + std::to_string(pp) +
           (virtual_stages > 1 ? " --virtual-stages " + std::to_string(virtual_stages) : "");
  }
};

// `schedule`: the options the LR schedule and the data order depend on, compared on resume.
// `layout`: {"tp", "pp", "virtual_stages"} of the run (what SavedLayout reads back), or null.
inline shardopt::TrainerState make_trainer_state(const RunState& s,
                                                 const nlohmann::json& schedule,
                                                 const nlohmann::json& layout = nullptr) {
  nlohmann::json j = {{"step", s.step},     {"data_position", s.data_position},
                      {"losses", s.losses}, {"train_s", s.train_s},
                      {"tokens", s.tokens}, {"schedule", schedule},
                      {"rows_per_position", s.rows_per_position}};
  if (!layout.is_null()) j["layout"] = layout;
  return {j.dump(), {{"torch_cpu_rng", cpu_rng_state()}}};
}

// Restores the run state and this rank's generator; returns notes for the log (e.g. schedule
// options that differ from the checkpoint's). `same_layout` false: a checkpoint of another
// tensor/pipeline layout, whose ranks' generators do not map onto this run's.
inline std::vector<std::string> restore_run_state(const shardopt::TrainerState& t,
                                                  const nlohmann::json& schedule, RunState* s,
                                                  bool same_layout = true) {
  const auto j = nlohmann::json::parse(t.json);
  std::vector<std::string> notes;
  s->step = j.at("step").get<int64_t>();
  s->data_position = j.at("data_position").get<int64_t>();
  // Another data-parallel size (or --tp) covers another number of rows per position: continue
  // at the same row of the data where the count divides.
  const int64_t saved_rows = j.value("rows_per_position", s->rows_per_position);
  if (saved_rows != s->rows_per_position && s->rows_per_position > 0) {
    const int64_t rows = s->data_position * saved_rows;
    s->data_position = rows / s->rows_per_position;
    if (rows % s->rows_per_position != 0) {
      notes.push_back("the checkpointed run read " + std::to_string(rows) + " rows, not a whole "
                      "number of this run's global micro-batches: the data continues from row " +
                      std::to_string(s->data_position * s->rows_per_position));
    }
  }
  s->losses = j.at("losses").get<std::vector<double>>();
  s->train_s = j.at("train_s").get<double>();
  s->tokens = j.at("tokens").get<int64_t>();
  for (const auto& [key, value] : schedule.items()) {
    const auto saved = j.at("schedule").value(key, nlohmann::json());
    if (saved != value) {
      notes.push_back("--" + key + " was " + saved.dump() + " in the checkpointed run, now " +
                      value.dump() + ": the run does not continue the same trajectory");
    }
  }
  auto rng = t.tensors.find("torch_cpu_rng");
  if (rng != t.tensors.end()) {
    set_cpu_rng_state(rng->second);
  } else if (!same_layout) {
    notes.push_back("written at another tensor/pipeline layout: the dropout generators start fresh");
  } else {
    notes.push_back("the checkpoint holds no generator state for this rank (was it in the "
                    "checkpointed run?): its dropout RNG starts fresh");
  }
  return notes;
}

// Keeps the metrics lines of steps <= `step` (a crashed run may have logged steps past its last
// checkpoint).
inline void truncate_metrics(const std::filesystem::path& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return;
  std::ostringstream kept;
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded() && j.value("step", int64_t{0}) <= step) kept << line << '\n';
  }
  in.close();
  std::ofstream(path, std::ios::trunc) << kept.str();
}

}  // namespace bert
