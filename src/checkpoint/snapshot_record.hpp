// A snapshot's record (Note [Snapshots in memory] in shardopt/snapshot.hpp): what a slot's tail
// says about its payload, read back and verified, and the restore at another world size (Note
// [Snapshots at another world size]). Internal to src/checkpoint/.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/format.hpp"
#include "checkpoint/snapshot_slot.hpp"
#include "shardopt/detail/partition.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/snapshot.hpp"

namespace shardopt::detail {

inline constexpr const char* kSnapshotFormat = "shardopt-snapshot";

// What a record must match to be restored here: this rank of this world, and the state's layout
// (stage, dtype, shard length, buckets, state buffers, groups, every parameter's name and shape).
json snapshot_fingerprint(ShardAccess& a, int world, int rank);
// The fingerprint's keys that resharding lets differ (the world and what follows from it).
bool fingerprint_key_follows_world(const std::string& key);
// Bytes of a slot's payload: the parameters and each state buffer, shard_numel elements each.
int64_t snapshot_payload_bytes(ShardAccess& a);

// The saving layout a record carries (Note [Snapshots at another world size]): this rank's index
// in the ranks the layout is sharded over, the shard length, each bucket's (shard, shard_offset)
// and each parameter's pieces (param, bucket, offset, param_offset, numel): enough for
// saved_pieces() (shardopt/detail/shard_plan.hpp), not depending on the world that reads it.
json snapshot_layout(ShardAccess& a);
json snapshot_layout(const FlatLayout& layout, int shard_rank);
// Back, checked (indices in range, every parameter of `params` covered once): Error{Checkpoint}
// naming `where`.
FlatLayout layout_from_snapshot(const json& j, int params, const std::string& where);

// A record read back: the slot mapped, both checksums verified, the JSON parsed.
struct SnapshotRecord {
  SlotPrefix prefix;
  json j;
  std::string tail;  // JSON text, then the trainer tensors' bytes
};
// Error{Checkpoint} naming the slot when it does not hold snapshot `number`, or a checksum fails,
// or the record is not a version-1 snapshot record.
SnapshotRecord open_snapshot_record(SlotFile& slot, int64_t number);

// What a restore installs, parsed from a record.
struct StagedSnapshot {
  int64_t steps = 0;
  std::vector<Rule> rules;
  std::optional<LossScaler::State> scaler;
  TrainerState trainer;  // json, and the tensors when parsed with them
};
StagedSnapshot parse_snapshot_record(ShardAccess& a, const SnapshotRecord& r,
                                     const std::string& where, bool with_tensors);

// The restore of snapshot `number`, committed by a world of `old_world` ranks, into this world
// (every rank of `world`, collective): Note [Snapshots at another world size]. nullopt on every
// rank alike with report->reason when it cannot be served; Error{Checkpoint} or Error{Mismatch}
// on every rank, no optimizer changed, when a record fails its checksum or does not fit.
std::optional<TrainerState> restore_resharded(ShardAccess& a, Communicator& world,
                                              const std::filesystem::path& dir, int64_t number,
                                              int old_world, RestoreReport* report);

}  // namespace shardopt::detail
