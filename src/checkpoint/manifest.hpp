// The manifest of a checkpoint: its parsed form (files, sections, parameters and their pieces),
// reading and checking it, verified shard loads, and building it from the optimizer at save time.
// Internal to src/checkpoint/.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "checkpoint/element_sums.hpp"
#include "checkpoint/format.hpp"
#include "checkpoint/placement.hpp"
#include "shardopt/checkpoint.hpp"  // kCheckpointFormatVersion
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/detail/shard_plan.hpp"
#include "shardopt/precision.hpp"

namespace shardopt::detail {

struct Section {
  int64_t offset = 0;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;  // 1-D for parameters and state
};

struct ShardFile {
  int rank = 0;
  std::string path;
  int64_t bytes = 0;
  uint32_t crc = 0;
  ShardChecksum checksum = ShardChecksum::Crc32c;  // of crc and block_crcs: the format version's
  std::map<std::string, Section> sections;
  // Note [Block checksums] (files.hpp): the checksum of every block_bytes block; empty in manifests
  // written before blocks were recorded (their readers read the whole file), and from format
  // version 3, whose files carry them (Note [Block tables]): block_count of them at
  // block_table_offset (-1: none), whose CRC-32C is block_table_crc.
  int64_t block_bytes = 0;
  std::vector<uint32_t> block_crcs;
  int64_t block_count = 0;
  int64_t block_table_offset = -1;
  uint32_t block_table_crc = 0;
};

struct ManifestParam {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int group = 0;
  std::vector<SavedPiece> pieces;
  // Its tensor-parallel split {dim, full_size, padded_size} (Note [Split records]); empty: not
  // split. `split_recorded` is false for manifests written before splits were recorded.
  std::vector<int64_t> split;
  bool split_recorded = false;
  // Where the split puts this copy (Note [Placement in the manifest], placement.hpp): its tensor
  // rank of how many; -1 in manifests written before placements were recorded.
  int split_rank = -1, split_ranks = -1;
  // Note [Element checksums] (element_sums.hpp): this folder's sum for the values and each state
  // buffer, in that order; empty in manifests written before they were recorded.
  std::vector<uint64_t> sums;
};

// The tensor rank and group size of parameter `index`'s split (0 and 1 when it has none).
std::pair<int, int> split_place_of_param(const ShardAccess& a, int index);

// This rank's copy of parameter `index`: its local shape and split record (Note [Placement in the
// manifest]).
TensorPlacement placement_of_param(const ShardAccess& a, int index);

// The element sums' hash of the format this build writes (Note [Element checksums]).
inline constexpr ElementHash kSavedElementHash =
    kCheckpointFormatVersion >= kMultiplyHashFormatVersion ? ElementHash::Multiply
                                                           : ElementHash::Mix64;

// The split of parameter `index` as a manifest records it: {dim, full_size, padded_size}, or
// empty where it is not split (or split trivially: one rank holding all of it, no padding).
std::vector<int64_t> split_of_param(const ShardAccess& a, int index);

struct Manifest {
  std::filesystem::path dir;
  std::filesystem::path path;
  json j;
  // The hash of the parameters' element sums: the format version's (Note [Element checksums]).
  ElementHash element_hash = ElementHash::Multiply;
  int world = 0;
  int stage = 0;
  at::ScalarType dtype = at::kFloat;
  int64_t step = 0;
  std::string rule;
  std::vector<std::string> state_names;
  std::vector<json> group_rules;
  std::optional<LossScaler::State> loss_scaler;  // fp16's dynamic loss scaler, when saved
  std::vector<ManifestParam> params;
  std::unordered_map<std::string, int> by_name;
  std::vector<ShardFile> files;  // by rank
};

// A verified shard file: its bytes and typed views of its sections.
struct LoadedShard {
  at::Tensor bytes;
  const ShardFile* file = nullptr;
  at::Tensor section(const std::string& name) const;
};

// Reads and checks <dir>/manifest.json (not the shard files).
Manifest read_manifest(const std::string& dir_text);
// The same checks on a manifest's text, as if it were <dir_text>/manifest.json (no file is read;
// the fuzz harness tests/fuzz/manifest_fuzz.cpp).
Manifest parse_manifest(const std::string& text, const std::string& dir_text);

// Rank `rank`'s shard file exists and has the size the manifest says (Note [Sizes from files]);
// read_full_state checks every file so before it allocates the full parameters.
void check_shard_size(const Manifest& m, int rank);

// Rank `rank`'s shard file, checked against the manifest (size, CRC-32, header).
LoadedShard load_shard(const Manifest& m, int rank);

// Note [Manifest checksum]: the manifest's own CRC-32, over its compact dump without the
// "manifest_crc32" field (nlohmann's objects are sorted, so the dump is canonical and survives a
// parse). An edit that keeps valid JSON (a piece offset changed by one) is caught on load.
// Manifests written before the field existed carry none and are read as before.
constexpr const char* kManifestCrc = "manifest_crc32";
uint32_t manifest_crc(json j);

// The manifest of a save: `names` are the state buffers, `files` every rank's shard entry,
// `module` SaveOptions' module state names and aliases (null: none).
json build_manifest(ShardAccess& a, const std::vector<std::string>& names, const json& trainer,
                    const std::vector<json>& files, const json& module = nullptr);

}  // namespace shardopt::detail
