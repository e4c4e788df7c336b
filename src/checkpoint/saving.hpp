// The save paths over any ShardAccess (the optimizer's, or an asynchronous save's snapshot of it:
// Note [Asynchronous saves] in shardopt/async_checkpoint.hpp). Internal to src/checkpoint/.
#pragma once

#include <string>

#include "shardopt/checkpoint.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/grid_checkpoint.hpp"

namespace shardopt::detail {

// save_checkpoint's body: one folder, collective over a.world_comm(). `manifest_crc`, when given,
// receives the manifest's "manifest_crc32" on the rank that wrote and published it (unchanged on
// the others): the grid commit takes it instead of reading that manifest back.
void save_folder(ShardAccess& a, const std::string& dir, const TrainerState& trainer,
                 const SaveOptions& options, std::string* manifest_crc = nullptr);

// save_grid_checkpoint's body: collective over `world` (groups gives the grid and this rank's
// position; its communicators are not used).
void save_grid(ShardAccess& a, Communicator& world, const ParallelGroups& groups,
               const std::string& base, const TrainerState& trainer, const SaveOptions& options,
               const GridSaveOptions& grid);

}  // namespace shardopt::detail
