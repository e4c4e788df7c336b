// Checkpoint files on disk: where a save goes (Paths), a writer that checksums and fsyncs, whole
// file reads, CRC-32, and the atomic publish of files and directories (Note [Atomic checkpoints] in
// shardopt/checkpoint.hpp). Internal to src/checkpoint/.
#pragma once

#include <ATen/core/Tensor.h>
#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/format.hpp"

namespace shardopt::detail {

struct Paths {
  std::filesystem::path dir;  // where the checkpoint is visible
  std::filesystem::path parent;
  std::filesystem::path tmp;  // .<name>.tmp: the save in progress (or a crashed one's leftovers)
  std::filesystem::path old;  // .<name>.old: only on filesystems without RENAME_EXCHANGE
};

Paths paths_of(const std::string& dir);

std::string shard_file_name(int rank, int world);

std::string errno_text();

// Note [No std::filesystem::remove_all]
// Removes a file or a directory tree, as std::filesystem::remove_all(path, ec) would; a path that
// does not exist is no error. Built on nftw, because pip's libtorch.so exports a static copy of
// std::filesystem whose remove_all jumps to a null address on a non-empty directory (torch 2.11,
// seen on a GPU machine: its recursive_directory_iterator::__erase is an unresolved weak symbol),
// and the dynamic linker may bind our calls to that copy rather than libstdc++'s.
void remove_tree(const std::filesystem::path& path, std::error_code& ec);

// Note [Block checksums]: besides the whole file's checksum, a shard file carries one per block of
// kBlockBytes (the last block shorter; in its manifest entry up to format version 2, in a table at
// the file's end from version 3: Note [Block tables]), so that a reader of a few byte ranges (a
// load into another layout reads only what overlaps its slice: Note [Placement in the manifest],
// src/checkpoint/placement.hpp) verifies every block it reads without reading the rest of the
// file. 4 KiB keeps the extra bytes per range small and the table at 0.1% of the file (0.2% as
// the manifest's hexadecimal text).
// They are CRC-32C from format version 2 (zlib's CRC-32 before: ShardChecksum in format.hpp); the
// file's is combined from its blocks', so the bytes are read once.
inline constexpr int64_t kBlockBytes = 4096;

// Note [Block tables]
// From format version 3 the block checksums are a binary table at the end of the shard file
// (one little-endian uint32 per block, the byte order of the file's header) rather than 8
// hexadecimal characters a block in the manifest: at 160,000 blocks per GB of state, the text was
// 1.3 MB per rank on BERT-base, which the save gathered to every rank, dumped twice on rank 0 and
// parsed on every load: 38% of an asynchronous save's writer CPU (perf), taken from the steps it
// overlaps. After the last section the file is zero-padded to a block boundary `table_offset`;
// the table there covers the blocks of [0, table_offset), and the file ends with it. The
// manifest's "blocks" records {"bytes": 4096, "count", "table_offset", "table_crc32c"}: the table's
// own CRC-32C, which a ranged read checks once it has read the table (4 bytes a block: 0.1% of
// the file) before it verifies any block against it; the whole file's CRC-32C covers the table
// too. A ranged read refuses bytes at or past table_offset: every byte it returns lies in a
// verified block.
// Versions 1 and 2 keep their table in the manifest's text (ShardFile::block_crcs).
inline constexpr const char* kBlockTableCrc = "table_crc32c";

// The checksum `kind` of [data, data + n).
uint32_t checksum_of(ShardChecksum kind, const void* data, int64_t n);

// Note [Direct shard writes]
// A shard file is large (a rank's whole state) and written once; through the page cache, write()
// copies every byte into freshly allocated cache pages, which on the build machine cost the
// writer more CPU than its checksums (perf: copy_folio_from_iter_atomic), CPU that an
// asynchronous save takes from the training's cores. With `direct`, the writer opens the file
// O_DIRECT and stages the bytes in one reused, page-aligned buffer of kDirectStaging bytes (a copy
// within the cache), written out whole, so the disk reads them by DMA; the last partial page is
// written zero-padded and the file truncated to its length before the fsync. Bytes that are
// already page-aligned in memory skip the staging copy: write_blocks() hands them to write() as
// they are (an asynchronous save's snapshot: Note [Shard images]). Where the filesystem refuses
// O_DIRECT (tmpfs, some network filesystems) the writer goes through the page cache.
inline constexpr size_t kDirectStaging = size_t{8} << 20;

// Writes a file sequentially, computing its CRC-32C and block CRC-32Cs on the way (Note [Block
// checksums]); sync() makes it durable. `direct`: Note [Direct shard writes].
class FileWriter {
 public:
  explicit FileWriter(std::filesystem::path path, bool direct = false);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  void write(const void* data, size_t bytes);
  // Whole blocks whose CRC-32Cs are known (`block_crcs`: one per kBlockBytes; Note [Shard images]),
  // at a block boundary of the file: written straight from `data` when it is page-aligned (O_DIRECT
  // too), else as write() would, without reading them to checksum them.
  void write_blocks(const void* data, size_t bytes, const uint32_t* block_crcs);
  void pad_to(int64_t alignment);
  void write_tensor(const at::Tensor& t);
  void sync_and_close();
  int64_t bytes() const { return bytes_; }
  bool direct() const { return staging_ != nullptr; }  // O_DIRECT was granted
  uint32_t crc() const;  // CRC-32C
  // The CRC-32C of every kBlockBytes block written so far (the last one possibly partial).
  std::vector<uint32_t> block_crcs() const;

 private:
  // Writes `bytes` from `data` to the file descriptor, retrying short writes.
  void write_out(const unsigned char* data, size_t bytes);
  void flush_staging(size_t bytes);
  void put(const unsigned char* p, size_t bytes);

  std::filesystem::path path_;
  int fd_ = -1;
  int64_t bytes_ = 0;
  struct FreeAligned {
    void operator()(unsigned char* p) const;
  };
  std::unique_ptr<unsigned char, FreeAligned> staging_;  // direct: page-aligned, kDirectStaging
  size_t staged_ = 0;                                     // bytes in staging_
  uint32_t crc_ = 0;  // CRC-32C of the finished blocks (combined from theirs)
  std::vector<uint32_t> blocks_;  // finished blocks
  uint32_t block_crc_ = 0;  // of the block being written
  void add_blocks(size_t first);  // folds blocks_[first, end) into crc_
};

void fsync_dir(const std::filesystem::path& dir);

// The whole file as bytes (64-byte aligned storage, so sections can be viewed in place).
at::Tensor read_bytes(const std::filesystem::path& path, const std::string& what);

std::string crc_text(uint32_t crc);
uint32_t crc_of(const at::Tensor& bytes);  // zlib's CRC-32 (manifests, version-1 shard files)

// Reads `bytes` bytes at `offset` of the open file `fd` (named `path` in errors) into `dst`.
void read_at(int fd, const std::filesystem::path& path, int64_t offset, int64_t bytes, void* dst);

// Writes `bytes` to `path` atomically: a temporary sibling, fsync, rename, fsync of the directory.
void write_file_atomically(const std::filesystem::path& path, const void* data, size_t bytes);

// Makes `p.tmp` visible as `p.dir` with one rename (exchanging with the previous checkpoint).
void publish(const Paths& p);

// Rank 0, before a save: the parent exists, leftovers of a crashed save are gone, and an existing
// `dir` is a checkpoint (never replace a directory that is something else).
void prepare_tmp(const Paths& p);

}  // namespace shardopt::detail
