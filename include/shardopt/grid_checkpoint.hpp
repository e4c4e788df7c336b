/// \file
/// Checkpoints of a tensor- and pipeline-parallel grid: one folder per (pipeline rank, tensor
/// rank), written by that position's data-parallel ranks, committed together by one record, and
/// loadable into any other grid, stage and world size, each rank reading only what it will hold.
///
///   shardopt::save_grid_checkpoint(opt, groups, "out/checkpoint", trainer);  // every rank
///   auto t = shardopt::load_grid_checkpoint(opt, groups, "out/checkpoint");  // any layout
///
/// Note [One commit for a grid]
/// A save goes to a new folder `<base>/save-NNNNNN/` holding `pp<p>-of-<P>/tp<t>-of-<T>/` for
/// every position of the grid (each an atomic checkpoint of its data-parallel ranks: Note [Atomic
/// checkpoints] in shardopt/checkpoint.hpp). When every folder is written, the world agrees;
/// then world rank 0 writes `<base>/commit.json` atomically (temporary file, fsync, rename, fsync
/// of the directory): the save's number, the optimizer step, the grid, and every folder with its
/// manifest's CRC-32, and the saves kept before it. Only that rename makes the save the one that
/// loads: a crash before it leaves the previous commit (and its folders) in place, and the next
/// save removes the uncommitted folder. A load reads commit.json and refuses a folder whose
/// manifest is not the one committed (another step, another save). After the commit, saves beyond
/// the last GridSaveOptions::keep are removed (torch DCP's single `.metadata` file written last
/// by the coordinator, and its keep-last-k).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shardopt/checkpoint.hpp"
#include "shardopt/parallel_layout.hpp"

namespace shardopt {

/// How save_grid_checkpoint commits.
struct GridSaveOptions {
  /// Committed saves kept (this one included); older ones are removed after the commit. >= 1.
  int keep = 1;
  /// Tests only (fault injection): called on every rank once its folder is written and synced,
  /// before the world agrees and commits; `world_rank` is the caller's. A throw (or a process
  /// killed) here leaves the previous commit as the one that loads.
  std::function<void(int world_rank)> after_folder_written;
  /// Tests only: called on world rank 0 just before it writes commit.json.
  std::function<void()> before_commit;
};

/// What load_grid_checkpoint read (GridLoadOptions::stats): bytes of checkpoint data this rank
/// read from the pieces' files (whole checksum blocks, Note [Block checksums]), of metadata
/// (commit record and manifests), and this rank's share: the bytes of the parameters and optimizer
/// state it holds after the load.
struct GridLoadStats {
  int64_t data_bytes = 0;      ///< bytes read from shard files
  int64_t metadata_bytes = 0;  ///< commit.json and the manifests read
  int64_t share_bytes = 0;     ///< this rank's owned parameters and state, in bytes
  int64_t files_opened = 0;    ///< shard files this rank opened
};

/// How load_grid_checkpoint restores.
struct GridLoadOptions {
  /// As LoadOptions (hyper-parameters, the model's buffers from world rank 0's stored ones).
  LoadOptions load;
  /// Where to put what this rank read (may be null).
  GridLoadStats* stats = nullptr;
};

/// What `<base>/commit.json` says (read_grid_commit).
struct GridCommit {
  int64_t save = 0;                         ///< the save's number (save-NNNNNN)
  int64_t step = 0;                         ///< the optimizer's step count at the save
  std::string path;                         ///< the committed save's folder, under base
  ParallelLayout layout;                    ///< tp, pp, and the dp of the run that saved
  std::vector<std::string> folders;         ///< every (pipeline, tensor) folder, under path
  std::vector<std::string> manifest_crc32;  ///< each folder's manifest CRC-32 (hexadecimal)
  std::vector<std::string> kept;            ///< committed saves kept, oldest first (path last)
};

/// The folder of grid position (tp_rank, pp_rank) in a save of `tp` x `pp`:
/// "pp<pp_rank>-of-<pp>/tp<tp_rank>-of-<tp>".
std::string grid_folder_name(int tp_rank, int tp, int pp_rank, int pp);

/// The folder of grid position (tp_rank, pp_rank) in the committed save under `base` (`base`
/// itself when it is a plain checkpoint folder), e.g. for consolidate_checkpoint or
/// read_full_state of one position. The checkpoint functions that take one folder
/// (load_checkpoint, read_checkpoint_info, read_full_state, consolidate_checkpoint) accept the base
/// of a grid of one (tp = pp = 1) as that folder. One process, not collective; Error{Checkpoint}
/// when there is no commit, or no such position in it.
std::string committed_folder(const std::string& base, int tp_rank = 0, int pp_rank = 0);

/// Reads and checks `<base>/commit.json` (one process, not collective). Throws Error{Checkpoint}
/// when it is missing (naming an uncommitted save left by a crash, if any) or corrupt.
GridCommit read_grid_commit(const std::string& base);

/// Saves this rank's part of the grid's checkpoint under `base` and commits the whole grid with one
/// record (Note [One commit for a grid]). `groups` is the grid (make_parallel_groups); `optimizer`
/// is this rank's, over groups.dp. Collective over groups.world: every rank calls it with the same
/// base. On any rank's failure every rank throws (the previous commit stays the one that loads).
void save_grid_checkpoint(DistributedOptimizer& optimizer, const ParallelGroups& groups,
                          const std::string& base, const TrainerState& trainer = {},
                          const SaveOptions& options = {}, const GridSaveOptions& grid = {});

/// Restores this rank's parameters and optimizer state from the committed save under `base`,
/// whatever grid (tp, pp, virtual stages), data-parallel size and ZeRO stage wrote it, for any
/// model whose split parameters carry their records (Note [Split records]): each parameter is
/// found by name in whichever pipeline folder holds it (a tied embedding saved by two stages
/// loads from either) and assembled from the pieces that overlap this rank's slice, read as byte
/// ranges (Note [Placement in the manifest]). `base` may also be a plain checkpoint folder
/// (save_checkpoint's, as a grid of one). Returns the trainer state: `json` of the first folder;
/// `tensors` that this data-parallel rank of this position saved, only when the grid (tp, pp) is
/// the save's (empty for ranks the saving run did not have). Collective over groups.world. Every
/// rank throws alike (Note [Agreement before state changes]): Error{Checkpoint} for a missing
/// commit or folder, a folder not of the committed step, a checksum mismatch; Error{Mismatch} for a
/// parameter the checkpoint lacks or whose unsplit shape or split dim differs.
TrainerState load_grid_checkpoint(DistributedOptimizer& optimizer, const ParallelGroups& groups,
                                  const std::string& base, const GridLoadOptions& options = {});

}  // namespace shardopt
