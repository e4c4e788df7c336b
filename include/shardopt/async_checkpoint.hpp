/// \file
/// Asynchronous grid checkpoints: the step waits only for a copy of this rank's state into host
/// memory; writing, syncing and the grid's commit run on a background thread.
///
///   shardopt::AsyncCheckpoint saver(opt, groups);              // collective: private groups
///   saver.save_checkpoint_async("out/checkpoint", trainer);    // returns after the copy
///   ... optimizer steps while it writes ...
///   saver.wait();   // or the next save_checkpoint_async: joins, throws a failure on every rank
///
/// Note [Asynchronous saves]
/// save_checkpoint_async first joins the save in flight (rethrowing its failure), then copies
/// this rank's owned slices of the master parameters and of every optimizer state buffer, the step
/// count, the rules and the loss scaler into a snapshot whose host buffers are allocated by the
/// first save and reused by every later one (pinned when the state lives on a GPU), and starts a
/// thread that runs save_grid_checkpoint's phases (folder, agreement, commit: Note [One commit for
/// a grid]) on the snapshot. The thread talks over its own copies of the world and data-parallel
/// communicators (split once, at construction), so its collectives never interleave with the
/// training's. Every phase ends in an agreement, so a failure is every rank's failure: the thread
/// keeps it, and the next save_checkpoint_async or wait() throws it on every rank. Until the
/// commit lands the previous commit is the one that loads, as for the synchronous save.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "shardopt/grid_checkpoint.hpp"

namespace shardopt {

/// Times of the last asynchronous save (seconds).
struct AsyncSaveTiming {
  double blocking_s = 0;    ///< inside save_checkpoint_async: joining the previous save, the copy
  double background_s = 0;  ///< the background thread: write, fsync, agreement, commit
  /// CPU seconds the background thread used (its checks, checksums and copies; not the
  /// communicators' threads): what a save takes from the training's cores.
  double background_cpu_s = 0;
};

/// How an AsyncCheckpoint runs its background saves.
struct AsyncCheckpointOptions {
  /// Added to the writer thread's nice value (Linux; 0..19): on cores the training keeps busy the
  /// step then loses less time to the writer's checksums and copies, and the write takes longer
  /// (bench/README.md, "Asynchronous checkpoints"). The communicators' threads keep theirs.
  int writer_niceness = 0;
};

/// Saves `optimizer`'s grid checkpoints in the background (Note [Asynchronous saves]). One per
/// optimizer; keeps references to both (they must outlive it).
class AsyncCheckpoint {
 public:
  /// Collective over groups.world: splits the private communicators of the background saves.
  AsyncCheckpoint(DistributedOptimizer& optimizer, const ParallelGroups& groups,
                  const AsyncCheckpointOptions& options = {});
  /// Joins a save in flight; its failure, if any, is dropped (call wait() to see it).
  ~AsyncCheckpoint();
  AsyncCheckpoint(const AsyncCheckpoint&) = delete;
  AsyncCheckpoint& operator=(const AsyncCheckpoint&) = delete;

  /// Joins the previous save (throwing its failure), snapshots this rank's state into the reused
  /// host buffer, and returns while a background thread writes and commits it under `base` as
  /// save_grid_checkpoint does. The trainer's and the module's tensors are copied too. Collective
  /// over groups.world (every rank calls it with the same base).
  void save_checkpoint_async(const std::string& base, const TrainerState& trainer = {},
                             const SaveOptions& options = {}, const GridSaveOptions& grid = {});
  /// Joins the save in flight, if any; throws its failure (Error of the failing rank's kind, the
  /// same on every rank). Not collective.
  void wait();
  /// True from a save until it is joined (by wait() or the next save).
  bool in_flight() const;
  /// The times of the last save (background_s once it has been joined).
  AsyncSaveTiming last_timing() const;
  /// Bytes of the host snapshot (0 before the first save).
  int64_t snapshot_bytes() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace shardopt
