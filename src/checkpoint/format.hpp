// The on-disk vocabulary of checkpoints: format names and constants, dtype names, the JSON codec of
// optimizer rules, and small shape helpers. Internal to src/checkpoint/.
//
// Note [Checkpoint layout]
//   <dir>/manifest.json                rank 0: format, world size, stage, precision, step, rule and
//                                      hyper-parameters per group, layout, every parameter's name,
//                                      shape, dtype, flat offset and pieces, every file's CRC-32
//   <dir>/shard-RRRRR-of-NNNNN.bin     rank R: a 64-byte header ("SHARDOPT", version, rank, world),
//                                      then 64-byte aligned sections: "param" (fp32 master
//                                      parameters), "state/<name>" per optimizer state buffer,
//                                      each the rank's owned slices of every bucket concatenated
//                                      ("shard coordinates"); then "trainer/<key>" tensors.
// A parameter's piece [rank, shard_begin, param_begin, numel] says that its elements
// [param_begin, param_begin + numel) sit at element shard_begin of every section of that rank's
// file, so a reader needs no knowledge of the bucketing that wrote them. adamw8bit's state
// sections hold codes, block maxima and packed fp32 moments instead of one element each: Note
// [Quantised state in checkpoints] (shardopt/detail/state_sections.hpp) maps elements to them.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardopt/rules.hpp"

namespace shardopt::detail {

using json = nlohmann::json;

inline constexpr const char* kFormat = "shardopt-checkpoint";
inline constexpr const char* kOptimizerFormat = "shardopt-optimizer-state";
inline constexpr const char* kManifest = "manifest.json";
// Rank 0's trainer tensors under this prefix are SaveOptions::module_state.
inline constexpr const char* kModulePrefix = "module/";
inline constexpr char kMagic[8] = {'S', 'H', 'A', 'R', 'D', 'O', 'P', 'T'};
inline constexpr int64_t kAlign = 64;

// The checksums of a shard file's manifest entry (the file's and its blocks': Note [Block
// checksums] in files.hpp): zlib's CRC-32 under "crc32" in format version 1, CRC-32C (Note
// [CRC-32C] in crc32c.hpp) under "crc32c" from version 2, which the save's snapshot copy computes
// in the same pass (Note [Shard images] in shard_image.hpp).
enum class ShardChecksum { Crc32, Crc32c };
inline constexpr int kCrc32FormatVersion = 1;  // the last version with CRC-32 shard checksums
// The first version whose shard files end with their block checksums (Note [Block tables] in
// files.hpp); versions 1 and 2 list them in the manifest as text.
inline constexpr int kBlockTableFormatVersion = 3;
// The first version whose element sums hash with ElementHash::Multiply (Note [Element checksums]
// in element_sums.hpp); versions 1 and 2 with ElementHash::Mix64.
inline constexpr int kMultiplyHashFormatVersion = 3;
inline const char* checksum_key(ShardChecksum c) {
  return c == ShardChecksum::Crc32 ? "crc32" : "crc32c";
}
inline const char* checksum_name(ShardChecksum c) {
  return c == ShardChecksum::Crc32 ? "CRC-32" : "CRC-32C";
}

// JSON text; invalid UTF-8 is replaced rather than thrown on.
std::string dump(const json& j, int indent = -1);

// "float32", "bfloat16", ...: the names manifests give dtypes.
std::string dtype_name(at::ScalarType t);
at::ScalarType dtype_from_name(const std::string& name, const std::string& where);

// {"rule": "adamw", "lr": ..., ...}: every field the rule declares, under its own name.
json rule_to_json(const Rule& rule);
Rule rule_from_json(const json& j);

std::string shape_text(const std::vector<int64_t>& shape);
int64_t numel_of(const std::vector<int64_t>& shape);
// Note [Sizes from files]: every count a file states is checked before it is used: no negative
// dimension, no product or sum past int64, nothing beyond the bytes the file really has, so that
// no input makes a reader allocate more than it reads. Error{Checkpoint} names `where` (file and
// field) and what is wrong.
int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& where);
// a + b and a * b of non-negative counts, Error{Checkpoint} naming `where` past int64.
int64_t checked_add(int64_t a, int64_t b, const std::string& where);
int64_t checked_mul(int64_t a, int64_t b, const std::string& where);
// The optimizer's step count from a file: 0 (no step taken) to 2^53 (each step adds one, and Adam's
// bias correction takes it as a double), Error{Checkpoint} naming `where` otherwise.
int64_t checked_step_count(int64_t step, const std::string& where);

}  // namespace shardopt::detail
