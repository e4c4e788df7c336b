/// \file
/// Snapshots in memory that outlive the process: every K steps each rank copies its state into a
/// shared-memory file on its own host and into the memory of a buddy rank on another host; a
/// restarted job continues from the newest snapshot the whole job committed, bitwise.
///
///   shardopt::MemorySnapshots snaps(opt, world, {"/dev/shm/shardopt-myjob"});   // collective
///   if (auto t = snaps.restore()) { ... continue from t->json ... }             // on start
///   for (...) { step(); snaps.snapshot(trainer_state()); }                      // every K steps
///
/// Note [Snapshots in memory]
/// Gemini (SOSP'23) recovers from CPU memory 13x faster than from storage; torchft keeps training
/// through failures but changes the batch. A snapshot here is the same state a checkpoint holds
/// (this rank's owned slices of the master parameters and of every optimizer state buffer, the
/// step count, the rules, the loss scaler, and the trainer's JSON and tensors: its data position
/// and RNG), so a restore continues the uninterrupted run bitwise. Each rank keeps two slots, files
/// `<dir>/rank<r>.slot<0|1>` on tmpfs (memory that survives the process, not the host), and holds
/// two more for its buddy, rank (r + ranks_per_host) mod world, on the next host:
/// `<dir>/copy-of-rank<b>.slot<0|1>`. Snapshot n goes to slot n mod 2, so the slot of the last
/// committed snapshot is never written while a newer one is in flight.
///
/// snapshot() joins the previous snapshot (throwing its failure on every rank), marks slot n
/// invalid, copies the state into it (the only time the step waits: one memcpy of the rank's
/// state) and returns. The copy checksums the bytes it moves (CRC-32C in the same pass, from the
/// registers they were loaded into), so that no one reads the slot back to checksum it: on cores
/// the steps already fill, the background's CPU is what a snapshot costs. A background thread,
/// over private communicators split at construction, writes the slot's header last, sends the
/// slot to the buddy while receiving the copy it holds for the rank whose buddy it is (header last
/// again; the copy is checksummed once, by restore()), and then every rank agrees.
/// Only once every rank has both copies does each write `<dir>/rank<r>.commit` (n, atomically):
/// the job's commit. A rank that saw the agreement may die before writing its marker, so restore
/// takes the newest n that any rank committed: the agreement for n proves every copy of n landed.
///
/// restore() runs on start, collective: each rank reports what its host holds (its own slots, the
/// copies it holds, its commit marker); the job picks the newest committed n, takes each rank's
/// record from its own host or, when that host's memory is gone (a replaced host), has the buddy
/// send it, verifies every checksum and that the record is of this rank, world, stage and layout,
/// agrees, and only then replaces the optimizer's state (Note [Agreement before state changes] in
/// shardopt/checkpoint.hpp). A snapshot of another world size is not restored (nullopt, with the
/// reason in RestoreReport): the caller falls back to its newest checkpoint on disk, which
/// reshards. Unlike a checkpoint, a snapshot does not store the model's buffers
/// (SaveOptions::module_state): a model whose buffers change in training passes them in
/// TrainerState::tensors.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "shardopt/checkpoint.hpp"
#include "shardopt/comm.hpp"

namespace shardopt {

/// Where and how MemorySnapshots keeps its copies.
struct SnapshotOptions {
  /// This host's directory for the slots, in memory that outlives the process (tmpfs: /dev/shm);
  /// created when missing. Ranks of one host may share it; one job per directory.
  std::string dir;
  /// Ranks per host, so that the buddy, rank (r + ranks_per_host) mod world, is on the next host.
  /// 0: counted (Communicator::split_by_host, which must give every host the same number). When it
  /// equals the world's size there is no other host and no buddy copy: a snapshot then survives
  /// the death of processes, not the loss of the host.
  int ranks_per_host = 0;
};

/// Times of the last snapshot (seconds).
struct SnapshotTiming {
  double blocking_s = 0;    ///< inside snapshot(): joining the previous one, the copy
  double background_s = 0;  ///< checksum, the buddy exchange, the agreement, the commit
  /// CPU time (CLOCK_THREAD_CPUTIME_ID) of the caller's thread inside snapshot(), and of the
  /// background thread; the communicator's own threads (MPI's worker, which moves the bytes of the
  /// exchange) are not in either: on a shared machine these, not the wall times, say what a
  /// snapshot costs.
  double blocking_cpu_s = 0;
  double background_cpu_s = 0;
};

/// What restore() found and did.
struct RestoreReport {
  bool restored = false;  ///< whether a snapshot was restored
  int64_t number = -1;  ///< the snapshot's number (counted by snapshot() calls over the job)
  int64_t step = 0;     ///< the optimizer's step count it holds
  int from_buddy = 0;   ///< ranks whose own host had lost their copy (sent by their buddy)
  double seconds = 0;   ///< the whole restore, on this rank
  /// Why nothing was restored: "no snapshot", "saved by a world of 4 ranks, this job has 2", ...
  std::string reason;
};

/// A job's snapshots in memory (Note [Snapshots in memory]). One per optimizer; keeps references
/// to the optimizer and the communicator's copies (the optimizer must outlive it).
class MemorySnapshots {
 public:
  /// Collective over `world` (every rank of the job, also in a tensor- or pipeline-parallel grid):
  /// splits the private communicators of the background exchange and maps this rank's slots.
  /// Error{InvalidArgument} for an empty dir or a ranks_per_host that does not divide the world,
  /// Error{Checkpoint} when the directory cannot be made.
  MemorySnapshots(DistributedOptimizer& optimizer, const CommunicatorPtr& world,
                  const SnapshotOptions& options);
  /// Joins a snapshot in flight; its failure, if any, is dropped (call wait() to see it).
  ~MemorySnapshots();
  MemorySnapshots(const MemorySnapshots&) = delete;
  MemorySnapshots& operator=(const MemorySnapshots&) = delete;

  /// Joins the previous snapshot (throwing its failure), copies this rank's state and `trainer`
  /// into the next slot and returns while the background thread checksums, exchanges with the
  /// buddy and commits. Collective over the world.
  void snapshot(const TrainerState& trainer = {});
  /// Joins the snapshot in flight, if any; throws its failure (the same on every rank).
  void wait();
  /// Restores the newest committed snapshot (Note [Snapshots in memory]); returns its trainer
  /// state (this rank's JSON and tensors), or nullopt on every rank alike when there is none this
  /// job can take (the reason in `report`). Collective. Error{Checkpoint} on every rank for a
  /// committed snapshot a rank cannot get (both copies lost) or whose checksum fails;
  /// Error{Mismatch} for one of the same world size but another model, stage or layout.
  std::optional<TrainerState> restore(RestoreReport* report = nullptr);

  /// Removes this rank's slots, the copies it holds for another rank and its commit marker, and
  /// the directory once empty: at the end of a job that finished, so that tmpfs gives the memory
  /// back (a crashed job's slots stay for its restart). Collective; joins the snapshot in flight
  /// first (throwing its failure). Later snapshots start afresh.
  void remove();

  /// The last snapshot's times (background_s once it has been joined).
  SnapshotTiming last_timing() const;
  /// Host memory the slots take on this rank's host for this rank: its two slots and the two it
  /// holds for another rank (0 before the first snapshot and restore).
  int64_t host_bytes() const;
  /// This rank's buddy (the rank holding its copies), or -1 when there is none.
  int buddy() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace shardopt
