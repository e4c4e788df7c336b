// The commit record of a grid's checkpoint (Note [One commit for a grid] in
// shardopt/grid_checkpoint.hpp): its file name, format, and parser; the whole model of a grid.
// Internal to src/checkpoint/.
#pragma once

#include <string>

#include "shardopt/grid_checkpoint.hpp"

namespace shardopt::detail {

inline constexpr const char* kCommitFile = "commit.json";
inline constexpr const char* kCommitFormat = "shardopt-grid-commit";

// Checks and parses the text of `<base>/commit.json` (its CRC-32, fields, folder names).
GridCommit parse_grid_commit(const std::string& text, const std::string& base);

// The whole model of the committed save under `base`, whatever grid (tp, pp, virtual stages) and
// data-parallel size wrote it: every folder's fp32 parameters, a split parameter's copies put back
// together along its split dimension without the padding (Note [Placement in the manifest]), a
// tied parameter saved by several stages taken from the first, with the saves' aliases and module
// state; no optimizer state. `base` may be a plain checkpoint folder. What consolidate_checkpoint
// writes for a grid's base. One process; Error{Checkpoint} for a missing commit, folder or
// tensor rank's part.
FullState read_grid_full_state(const std::string& base);

}  // namespace shardopt::detail
