// The snapshot of an asynchronous save laid out as its shard file's first bytes, checksummed and
// checked by the copy that fills it (see the Note). Internal to src/checkpoint/.
//
// Note [Shard images]
// An asynchronous save (Note [Asynchronous saves] in shardopt/async_checkpoint.hpp) copies the
// rank's state while the step waits, then writes it on a background thread. Where the ranks' steps
// fill every core, each CPU second of that thread lands on a step (issue 55: 0.45 s per BERT-base
// shard, the step 1.5x slower), so the copy takes over what it can do in its one pass:
//   - it lays the state out as the shard file's bytes [0, bytes()): the 64-byte header, then the
//     "param" section and each "state/<name>" section at their file offsets (Note [Checkpoint
//     layout]), in one page-aligned buffer, zeroed once, so that padding is zeros as on disk;
//   - it copies four 4 KiB blocks at a time, each with its own CRC-32C stream (Note [CRC-32C]),
//     storing non-temporally: the block checksums of Note [Block checksums] come out of the copy;
//     blocks no copy covered whole (the header, padding, the edges of bucket slices: a few per
//     bucket) are checksummed from the buffer once the copy is done;
//   - per chunk of kImageChunk bytes, while the source chunk is still in cache, it runs the
//     non-finite check (Note [Exact non-finite check]).
// On BERT-base's 660 MB shard that pass takes 1.1-1.2x one memcpy (the buffer in transparent huge
// pages: O_DIRECT pins its pages for every write). The element sums (Note
// [Element checksums]) stay on the writer: their hash is bound by 64-bit multiplies (three per
// element), 0.045 s per shard even from L2, which would make the copy 2x a memcpy (the aim is
// 1.2x). The writer hands the whole blocks to write() straight from the buffer, O_DIRECT (Note
// [Direct shard writes]: the disk reads the snapshot by DMA, no staging copy), and appends the
// last partial block and the trainer tensors through FileWriter. Only where the optimizer's slices
// are not contiguous host tensors of the section's dtype (a GPU's state) does the snapshot keep a
// tensor per section (pinned) and the writer do the synchronous save's work itself.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/staging.hpp"  // StateSections
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/detail/state_sections.hpp"

namespace shardopt::detail {

// Bytes per chunk of the copy: the source chunk stays in L2 for the checks that follow.
inline constexpr int64_t kImageChunk = int64_t{128} << 10;

// The 64-byte header of a shard file: "SHARDOPT", the format version, rank, world.
std::array<char, 64> shard_header(int rank, int world);

struct ImageSection {
  std::string name;  // "param", "state/<name>"
  int64_t offset = 0;
  at::ScalarType dtype = at::kFloat;
  int64_t entries = 0;
};

class ShardImage {
 public:
  // Whether `a`'s owned slices can be copied by the image (contiguous CPU tensors of each section's
  // dtype).
  static bool fits(ShardAccess& a);
  // Lays out and allocates the image of `a`'s shard (its rank and size in a.comm()).
  explicit ShardImage(ShardAccess& a);
  ~ShardImage();
  ShardImage(const ShardImage&) = delete;
  ShardImage& operator=(const ShardImage&) = delete;

  // Copies `a`'s owned slices in (the training waits), with the checksums and checks.
  void take(ShardAccess& a);

  const uint8_t* data() const { return data_; }
  int64_t bytes() const { return bytes_; }  // header and sections: the trainer's tensors follow
  // The CRC-32C of each whole block in [0, bytes() / kBlockBytes * kBlockBytes).
  const std::vector<uint32_t>& block_crcs() const { return blocks_; }
  const std::vector<ImageSection>& sections() const { return sections_; }
  // Section k's slice of bucket `bucket` (a view into the image).
  at::Tensor slice(int k, int bucket) const;
  // Whether the last take() checked the slice (a floating element-wise section) and found every
  // value finite; false: not checked, or not finite.
  bool checked_finite(int k, int bucket) const {
    return finite_[static_cast<size_t>(k) * buckets_ + static_cast<size_t>(bucket)] != 0;
  }
 private:
  // Copies n bytes from src to the image at `at`, checksumming its whole blocks.
  void copy(int64_t at, const uint8_t* src, int64_t n);

  const FlatLayout* layout_;
  uint8_t* data_ = nullptr;
  int64_t bytes_ = 0;
  size_t buckets_ = 0;
  std::vector<ImageSection> sections_;
  StateSections state_;
  std::vector<at::Tensor> views_;  // per section, over the image
  std::vector<uint32_t> blocks_;
  std::vector<uint8_t> covered_;  // per block: its CRC came from a copy
  std::vector<uint8_t> finite_;   // [section][bucket]
};

// Implemented by a ShardAccess that has its shard as an image (the asynchronous save's snapshot);
// the shard writer then writes the image (save_load.cpp).
class ShardImageSource {
 public:
  virtual ~ShardImageSource() = default;
  virtual const ShardImage* shard_image() const = 0;  // nullptr: none
};

}  // namespace shardopt::detail
