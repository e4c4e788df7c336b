// Reading byte ranges of a shard file, each block it touches verified against its block
// checksums (Note [Block checksums] in files.hpp), and counted. Internal to src/checkpoint/.
#pragma once

#include <cstdint>
#include <filesystem>
#include <vector>

#include "checkpoint/manifest.hpp"

namespace shardopt::detail {

// Copy `bytes` bytes at byte `offset` of the file to `dst`.
struct RangeRead {
  int64_t offset = 0, bytes = 0;
  char* dst = nullptr;
};

// Reads `reads` from file `f` of manifest `m` (which must exist with the size the manifest says).
// `verify` true: the blocks they touch, each read once and verified (a file whose manifest predates
// block checksums is read whole and verified by its CRC-32); false: exactly the bytes asked for
// (adjacent reads merged), which the caller verifies (Note [Element checksums]). Returns the bytes
// read from disk. Error{Checkpoint} names the file and block on a mismatch.
int64_t read_ranges(const Manifest& m, const ShardFile& f, std::vector<RangeRead> reads,
                    bool verify = true);

}  // namespace shardopt::detail
