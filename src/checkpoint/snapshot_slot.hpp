// One slot of an in-memory snapshot (Note [Snapshots in memory] in shardopt/snapshot.hpp): a file
// on tmpfs holding a 64-byte prefix, the payload (the rank's owned slices, mapped into memory so
// that the step's copy and the buddy's receive write it in place) and a tail (the record's JSON
// and the trainer's tensors). Internal to src/checkpoint/.
//
//   [0, 64)            prefix: "SHSNAP01", number (-1: being written), payload and tail bytes,
//                      the JSON's length, CRC-32C of the payload's four quarters and of the tail,
//                      and the prefix's own CRC-32C
//   [64, 64 + P)       payload
//   [64 + P, ... )     tail: JSON text, then the trainer tensors' bytes
// The prefix is written last: a process killed while a slot is written leaves number -1 (or a
// payload whose checksum fails), never a record that looks whole.
#pragma once

#include <array>
#include <cstdint>
#include <istream>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/crc32c.hpp"

namespace shardopt::detail {

struct SlotPrefix {
  int64_t number = -1;
  int64_t payload_bytes = 0;
  int64_t tail_bytes = 0;
  int64_t json_bytes = 0;
  std::array<uint32_t, 4> payload_crc{};
  uint32_t tail_crc = 0;
};
inline constexpr int64_t kSlotPrefixBytes = 64;

// The payload's and the tail's checksums: CRC-32C (Note [CRC-32C] in crc32c.hpp), the payload's
// per quarter (crc32c_quarters).

// The payload's quarters' CRC-32C (crc32c_quarters' four values) computed while the payload is
// written in pieces, in any order: copy() copies a piece and checksums it in the same pass, from
// the registers the bytes were loaded into, so the slot is never read again to checksum it (Note
// [Snapshots in memory]); finish() combines the pieces' CRCs (CRC is linear: the CRC of A then B
// is A's shifted by |B| bytes xor B's) and reads only bytes no piece wrote.
class PayloadChecksum {
 public:
  PayloadChecksum(uint8_t* payload, int64_t payload_bytes);
  // Copies [src, src + n) to payload + at (inside the payload; pieces must not overlap).
  void copy(int64_t at, const void* src, int64_t n);
  std::array<uint32_t, 4> finish();

 private:
  struct Piece {
    int64_t at, n;
    uint32_t crc;  // the CRC register over the piece from 0, neither pre- nor post-inverted
  };
  uint8_t* payload_;
  int64_t n_, q_;
  std::vector<Piece> pieces_;
};

// The 64 bytes of a prefix, and back (nullopt: not a valid prefix).
std::array<uint8_t, kSlotPrefixBytes> encode_prefix(const SlotPrefix& p);
std::optional<SlotPrefix> decode_prefix(const uint8_t* bytes);

class SlotFile {
 public:
  explicit SlotFile(std::string path) : path_(std::move(path)) {}
  ~SlotFile();
  SlotFile(const SlotFile&) = delete;
  SlotFile& operator=(const SlotFile&) = delete;

  const std::string& path() const { return path_; }
  // Maps prefix + payload for `payload_bytes` (creating or resizing the file, its memory reserved
  // with fallocate so that a full tmpfs is an Error{Checkpoint} here and never a SIGBUS later);
  // kept mapped while the size stays. Returns the payload's first byte.
  uint8_t* map(int64_t payload_bytes);
  const uint8_t* prefix() const { return base_; }
  uint8_t* payload() const { return base_ + kSlotPrefixBytes; }
  int64_t mapped_payload() const { return payload_bytes_; }

  // Marks the slot as being written (number -1).
  void invalidate();
  // Writes the tail after the payload and trims the file to its end.
  void write_tail(const std::string& tail);
  // Writes the prefix (last).
  void write_prefix(const std::array<uint8_t, kSlotPrefixBytes>& prefix);

  // Reading without mapping (restore's survey): the prefix, nullopt when the file is missing or
  // the prefix is not whole; the tail of a prefix.
  std::optional<SlotPrefix> read_prefix() const;
  std::string read_tail(const SlotPrefix& p) const;

 private:
  void unmap();
  std::string path_;
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  int64_t payload_bytes_ = -1;
};

// Note [Huge pages for the slots]
// The buddy exchange is a message between two processes, which MPI's shared-memory transport copies
// once (CMA: process_vm_readv), pinning the source's pages one by one. On a tmpfs with 4 KiB pages
// that costs about 1.7x the CPU of the same copy from huge pages: BERT-base at N = 2, 630 MiB per
// snapshot, 0.09-0.16 s against 0.05-0.09 s, and K = 1 cost 1.12-1.15x the step against
// 1.06-1.09x (bench/log/2026-11-28-snapshot-huge-pages.md). tmpfs takes huge pages from its mount
// option (huge=within_size or always): fallocate, which reserves the slots' memory, has no mapping
// for madvise to steer. /dev/shm is usually mounted without it, so the library says so once.
//
// Whether `dir` lies on a tmpfs mounted without huge pages (/proc/mounts, longest mount point
// that is a prefix of the directory's canonical path); false when it cannot tell. The second form
// reads `mounts` (the format of /proc/mounts) for a canonical `path`.
bool tmpfs_without_huge_pages(const std::string& dir);
bool tmpfs_without_huge_pages(const std::string& path, std::istream& mounts);

}  // namespace shardopt::detail
