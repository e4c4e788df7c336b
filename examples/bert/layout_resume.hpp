// Checkpoints across tensor- and pipeline-parallel layouts (bert_pretrain --resume at another
// --tp, --pp or --virtual-stages).
//
// Each (tensor rank, pipeline rank)'s optimizer checkpoints its own stages' parameters, its own
// slices of them, into checkpoint_path(base, tp_rank, tp, pp_rank, pp) (run.hpp), and the trainer
// state records the layout: T, P, V and, for each split parameter, the dimension it is split
// along, its unsplit size and its padded size. A run of the same layout resumes from its own
// folder at any data-parallel size and stage (shardopt's checkpoints reshard). A run of another
// layout reads every folder: for each parameter its stages hold (found by name in whichever
// stage folder has it; the tied word embedding is in the first and the last, equal), it joins the
// tensor ranks' parts and their optimizer state (Adam's moments have the parameter's shape) along
// the recorded split, drops the padding, and keeps its own slice (load_full_state). Each rank then
// reads the whole model and its state for a moment: the example's way, not a large model's.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "run.hpp"

namespace bert {

// The layout a checkpoint was written at (the folders under its base, and V from its trainer
// state).
struct SavedLayout {
  int tp = 1, pp = 1, virtual_stages = 1;
  bool same_folders(const SavedLayout& o) const { return tp == o.tp && pp == o.pp; }
  bool operator==(const SavedLayout& o) const {
    return same_folders(o) && virtual_stages == o.virtual_stages;
  }
  std::string describe() const;  // "--tp 2 --pp 2", plus " --virtual-stages V" when V > 1
};

// What make_trainer_state records of this run's layout (null at --tp 1 --pp 1).
nlohmann::json layout_json(const Run& r);
SavedLayout layout_of(const Run& r);

// The layout of the run whose checkpoint is under `base`: from the folders it holds (manifest.json,
// tp0-of-T, pp0-of-P[/tp0-of-T]). Throws UsageError naming `base` when it holds none of them.
SavedLayout saved_layout(const std::filesystem::path& base);

// Restores the checkpoint under `base`, written at `saved`, into this run's model and optimizer
// (collective). Every folder must be at the same step (else a save was cut off between two of
// them: UsageError naming both). The generator state is not restored across layouts (the dropout
// streams differ anyway): the returned trainer state has none.
shardopt::TrainerState load_checkpoint_any_layout(Run& r, const std::filesystem::path& base,
                                                  const SavedLayout& saved);

}  // namespace bert
