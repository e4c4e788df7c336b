// Checkpoints across tensor-parallel layouts (bert_pretrain --resume at another --tp).
//
// At --tp T each tensor rank's optimizer checkpoints its own slices into base/tp<k>-of-<T> (at
// --tp 1, base itself), and the trainer state records the layout: T and, for each split
// parameter, the dimension it is split along, its unsplit size and its padded size. A run at the
// same T resumes from its own directory, at any data-parallel size and stage (shardopt's
// checkpoints reshard). A run at another T reads every tensor rank's part, joins each split
// parameter and its optimizer state (Adam's moments have the parameter's shape) along the
// recorded split, drops the padding, and keeps its own slice (load_full_state). Each rank then
// holds the whole model and its state for a moment: the example's way, not a large model's.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>

#include "run.hpp"

namespace bert {

// What make_trainer_state records of this run's layout (null at --tp 1).
nlohmann::json layout_json(const Run& r);

// The --tp of the run whose checkpoint is under `base`: 1 when base holds a checkpoint itself,
// T when it holds tp0-of-T, ... Throws UsageError naming `base` when it holds neither.
int saved_tensor_parallel(const std::filesystem::path& base);

// Restores the checkpoint under `base`, written at --tp saved_tp, into this run's model and
// optimizer (collective). The generator state is not restored across layouts (the dropout
// streams differ anyway): the returned trainer state has none.
shardopt::TrainerState load_checkpoint_any_layout(Run& r, const std::filesystem::path& base,
                                                  int saved_tp);

}  // namespace bert
