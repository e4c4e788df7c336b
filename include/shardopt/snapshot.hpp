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
/// shardopt/checkpoint.hpp). A snapshot of another world size is resharded (Note [Snapshots at
/// another world size]). Unlike a checkpoint, a snapshot does not store the model's buffers
/// (SaveOptions::module_state): a model whose buffers change in training passes them in
/// TrainerState::tensors.
///
/// Note [Snapshots at another world size]
/// A host that is lost and not replaced leaves a job of fewer ranks (N = 4 over 2 hosts restarts
/// at M = 2 on host 0, whose tmpfs holds ranks 0 and 1's records and the copies of ranks 2 and 3);
/// a new host makes more (M > N; its ranks hold nothing); a job of the same size may find records
/// on other hosts than their ranks' and buddies' (N = 4 again, all on host 0, no buddies: ranks 2
/// and 3's records are copies there). restore() then reshards as a checkpoint on disk does, with
/// the same index maths: every record carries the saving layout (each bucket's shard and shard
/// offset, each parameter's pieces: detail::snapshot_layout), so saved_pieces() and plan_copies()
/// (shardopt/detail/shard_plan.hpp) map old rank q's slices onto each new rank's owned elements
/// (padding keeps its values, as in load_checkpoint). Only the source differs: where
/// load_checkpoint reads the byte ranges of old rank q's file that overlap the new shard, here
/// the rank that holds q's record (its own slot file or a buddy's copy, in any rank's directory;
/// every rank's commit marker there counts for the newest commit) sends those ranges:
///   1. each rank reports which old records its directory holds of the newest committed snapshot;
///      each record gets one server (a rank holding the record itself before one holding a copy,
///      then the least loaded); a record held nowhere: nullopt with the reason ("old rank 3's
///      record of it is on no host ...") and the caller loads its checkpoint on disk;
///   2. each server verifies every record it serves (both CRC-32Cs, the fingerprint's model,
///      stage, dtype, state buffers and groups; the layout) before anything is sent; old rank 0's
///      record (step, rules, loss scaler, trainer JSON, layout) is broadcast;
///   3. every rank computes the same plan, so that no request is sent: each server sends, per new
///      rank, the runs of the parameters and of every state buffer it owes straight from the
///      mapped record (runs of neighbouring parameters joined; batch_isend_irecv) into a buffer;
///   4. every rank agrees that it has everything; only then does any optimizer change: the
///      received runs, and those of the records it serves itself, copied bucket by bucket.
/// The trainer state is what load_checkpoint gives at another world size: old rank 0's JSON on
/// every rank (trainers write the same JSON on every rank), old rank r's tensors on new rank r,
/// none on new ranks past the old world (their generators stay as they are). The data position is
/// the trainer's: the BERT example counts it in rows (RunState::rows_per_position) and continues
/// at the same row, as from a checkpoint on disk. The run continues bitwise as the one resumed
/// from a disk checkpoint of the same step, and within rounding of the run at M never interrupted
/// when each rank's loss weighs its rows alike (a per-rank mean over masked tokens, as BERT's, is
/// another objective at another partition: about 3e-4 apart in tests/fault). Not resharded
/// (nullopt with the reason; the disk checkpoint does it): hybrid sharding and model-parallel
/// grids (the layout is sharded over a group, not the world), and records written before records
/// carried their layout. After the new world's first commit each rank removes from its directory
/// the files of old ranks q >= M (and every copy when there are no buddies): tmpfs gives their
/// memory back.
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
  /// CPU time (CLOCK_THREAD_CPUTIME_ID) of the caller's thread inside snapshot(); the
  /// communicator's own threads (MPI's worker, which moves the bytes of the exchange) are in
  /// neither CPU time: on a shared machine these, not the wall times, say what a snapshot costs.
  double blocking_cpu_s = 0;
  double background_cpu_s = 0;  ///< CPU time of the background thread for the snapshot
};

/// What restore() found and did.
struct RestoreReport {
  bool restored = false;  ///< whether a snapshot was restored
  int64_t number = -1;  ///< the snapshot's number (counted by snapshot() calls over the job)
  int64_t step = 0;     ///< the optimizer's step count it holds
  /// Records taken from a buddy's copy: at the same world size, ranks whose own host had lost
  /// theirs (sent by their buddy); at another, old records served from a copy.
  int from_buddy = 0;
  /// The world size that saved it; another than this job's: the state was resharded (Note
  /// [Snapshots at another world size]). 0 when there was no snapshot.
  int saved_world = 0;
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
  /// Restores the newest committed snapshot (Note [Snapshots in memory]), resharding one saved by
  /// a world of another size (Note [Snapshots at another world size]); returns its trainer state
  /// (this rank's JSON and tensors; at another world size old rank 0's JSON and old rank r's
  /// tensors), or nullopt on every rank alike when there is none this job can take (the reason in
  /// `report`: no snapshot, a record lost on every host (both copies), a layout that does not
  /// reshard from memory). Collective. Error{Checkpoint} on every rank, no optimizer changed, for
  /// a record whose checksum fails; Error{Mismatch} for one of another model, stage or layout.
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
