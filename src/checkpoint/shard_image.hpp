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
//   - it walks each bucket's slice of each section as runs: every parameter's piece, and the
//     padding between. A run's whole 4 KiB blocks of 4-byte elements at consecutive indices (an
//     unsplit parameter) go through copy_blocks_summed (image_copy.hpp): three blocks at a time,
//     one load of each 64 bytes feeding the non-temporal store, the block's CRC-32C stream (Note
//     [CRC-32C]), the non-finite check (Note [Exact non-finite check]) and the element sums'
//     hash (Note [Element checksums]), whose arithmetic hides under the memory's time;
//   - the rest (a run's edges, 1-, 2- and 8-byte elements, split parameters) is copied per chunk
//     of kImageChunk bytes with its whole blocks' CRC-32Cs, then checked and summed from L2;
//     blocks no copy covered whole (the header, padding, the runs' edges) are checksummed from
//     the buffer once the copy is done.
// The element sums of every element-wise section then come from the copy (summed(k)); those of
// 8-bit AdamW's block and packed sections (Note [Quantised state in checkpoints]) the writer still
// computes. On BERT-base's 660 MB shard that pass blocks the step for 0.047-0.05 s, 0.85-0.89x one
// memcpy with both ranks copying (the image in transparent huge pages: O_DIRECT pins its pages for
// every write), and the writer's CPU per save falls from 0.04-0.05 s to 0.01 s (the bench log
// 2026-11-28-async-checkpoints-one-pass.md). The writer hands the whole blocks to write() straight from the buffer, O_DIRECT
// (Note [Direct shard writes]: the disk reads the snapshot by DMA, no staging copy), and appends
// the last partial block and the trainer tensors through FileWriter. Only where the optimizer's
// slices are not contiguous host tensors of the section's dtype (a GPU's state) does the snapshot
// keep a tensor per section (pinned) and the writer do the synchronous save's work itself.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/placement.hpp"  // TensorPlacement
#include "checkpoint/staging.hpp"    // StateSections
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/detail/state_sections.hpp"

namespace shardopt::detail {

// Bytes per chunk of the copy where it is not one pass: the source chunk stays in L2 for the
// check and the element sums that follow.
inline constexpr int64_t kImageChunk = int64_t{128} << 10;

struct ImageRun;  // shard_image.cpp

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
  // Whether the last take() summed section k's elements (Note [Element checksums]: its
  // element-wise sections), and this rank's part of parameter i's sum there.
  bool summed(int k) const { return summed_[static_cast<size_t>(k)] != 0; }
  uint64_t element_sum(int i, int k) const {
    return sums_[static_cast<size_t>(i) * sections_.size() + static_cast<size_t>(k)];
  }

 private:
  // Copies n bytes from src to the image at `at`, checksumming its whole blocks.
  void copy(int64_t at, const uint8_t* src, int64_t n);
  // Copies a run of elements with its checks and sums: whole blocks in one pass where it can,
  // else (and the edges) in chunks. Returns whether every element checked was finite.
  bool copy_run(const ImageRun& r);
  bool copy_chunks(const ImageRun& r);

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
  std::vector<TensorPlacement> places_;  // per parameter
  std::vector<uint64_t> sums_;           // [parameter][section]
  std::vector<uint8_t> summed_;          // [section]
};

// Implemented by a ShardAccess that has its shard as an image (the asynchronous save's snapshot);
// the shard writer then writes the image (save_load.cpp).
class ShardImageSource {
 public:
  virtual ~ShardImageSource() = default;
  virtual const ShardImage* shard_image() const = 0;  // nullptr: none
};

}  // namespace shardopt::detail
