// The commit record of a grid's checkpoint (Note [One commit for a grid] in
// shardopt/grid_checkpoint.hpp): its file name, format, and parser. Internal to src/checkpoint/.
#pragma once

#include <string>

#include "shardopt/grid_checkpoint.hpp"

namespace shardopt::detail {

inline constexpr const char* kCommitFile = "commit.json";
inline constexpr const char* kCommitFormat = "shardopt-grid-commit";

// Checks and parses the text of `<base>/commit.json` (its CRC-32, fields, folder names).
GridCommit parse_grid_commit(const std::string& text, const std::string& base);

}  // namespace shardopt::detail
