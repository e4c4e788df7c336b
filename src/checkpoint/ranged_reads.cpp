// Ranged, verified reads of shard files (see ranged_reads.hpp).
#include "checkpoint/ranged_reads.hpp"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "checkpoint/files.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail {

namespace {

// Blocks read with one call at most (64 MiB of 4 KiB blocks): memory stays bounded.
constexpr int64_t kBlocksPerRead = 16384;

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

int64_t read_ranges(const Manifest& m, const ShardFile& f, std::vector<RangeRead> reads,
                    bool verify) {
  const std::filesystem::path path = m.dir / f.path;
  check_shard_size(m, f.rank);
  reads.erase(
      std::remove_if(reads.begin(), reads.end(), [](const RangeRead& r) { return r.bytes <= 0; }),
      reads.end());
  if (reads.empty()) return 0;
  for (const RangeRead& r : reads) {
    SHARDOPT_CHECK(r.offset >= 0 && r.offset + r.bytes <= f.bytes, Checkpoint,
                   "checkpoint: bytes [{}, {}) lie outside {} ({} bytes)", r.offset,
                   r.offset + r.bytes, path.string(), f.bytes);
  }
  if (!verify) {  // exactly the ranges, adjacent ones in one call
    std::sort(reads.begin(), reads.end(),
              [](const RangeRead& x, const RangeRead& y) { return x.offset < y.offset; });
    Fd fd;
    fd.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    SHARDOPT_CHECK(fd.fd >= 0, Checkpoint, "checkpoint: shard file {} cannot be read: {}",
                   path.string(), errno_text());
    int64_t total = 0;
    std::vector<char> buffer;
    for (size_t k = 0; k < reads.size();) {
      size_t stop = k + 1;
      int64_t end = reads[k].offset + reads[k].bytes;
      while (stop < reads.size() && reads[stop].offset == end &&
             end - reads[k].offset < (int64_t{64} << 20)) {
        end += reads[stop].bytes;
        ++stop;
      }
      if (stop == k + 1) {
        read_at(fd.fd, path, reads[k].offset, reads[k].bytes, reads[k].dst);
      } else {
        buffer.resize(static_cast<size_t>(end - reads[k].offset));
        read_at(fd.fd, path, reads[k].offset, end - reads[k].offset, buffer.data());
        for (size_t j = k; j < stop; ++j) {
          std::memcpy(reads[j].dst, buffer.data() + (reads[j].offset - reads[k].offset),
                      static_cast<size_t>(reads[j].bytes));
        }
      }
      total += end - reads[k].offset;
      k = stop;
    }
    return total;
  }
  if (f.block_crcs.empty() && f.block_table_offset < 0) {  // the whole file, as load_shard reads it
    const LoadedShard whole = load_shard(m, f.rank);
    const auto* bytes = static_cast<const char*>(whole.bytes.data_ptr());
    for (const RangeRead& r : reads) std::memcpy(r.dst, bytes + r.offset, r.bytes);
    return f.bytes;
  }
  std::sort(reads.begin(), reads.end(),
            [](const RangeRead& x, const RangeRead& y) { return x.offset < y.offset; });
  Fd fd;
  fd.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  SHARDOPT_CHECK(fd.fd >= 0, Checkpoint, "checkpoint: shard file {} cannot be read: {}",
                 path.string(), errno_text());
  const int64_t B = f.block_bytes;
  // Note [Block tables]: the file's own table covers the bytes before it (parse_manifest checked
  // where it lies); read and checked before any block is verified against it.
  std::vector<uint32_t> table;
  int64_t covered = f.bytes;
  int64_t read_bytes_total = 0;
  if (f.block_table_offset >= 0) {
    covered = f.block_table_offset;
    table.resize(static_cast<size_t>(f.block_count));
    const auto table_bytes = static_cast<int64_t>(table.size() * sizeof(uint32_t));
    read_at(fd.fd, path, covered, table_bytes, table.data());
    read_bytes_total += table_bytes;
    const uint32_t crc = checksum_of(ShardChecksum::Crc32c, table.data(), table_bytes);
    SHARDOPT_CHECK(crc == f.block_table_crc, Checkpoint,
                   "checkpoint: checksum mismatch in the block table of shard file {} (bytes [{}, "
                   "{})): CRC-32C is {}, the manifest says {}; the file is corrupt",
                   path.string(), covered, covered + table_bytes, crc_text(crc),
                   crc_text(f.block_table_crc));
  }
  const std::vector<uint32_t>& block_crcs = f.block_table_offset >= 0 ? table : f.block_crcs;
  const int64_t blocks = static_cast<int64_t>(block_crcs.size());
  SHARDOPT_CHECK(blocks == (covered + B - 1) / B, Checkpoint,
                 "checkpoint: {}: the {} block checksums of {} do not fit its {} bytes in {}-byte "
                 "blocks",
                 m.path.string(), blocks, f.path, covered, B);
  for (const RangeRead& r : reads) {
    SHARDOPT_CHECK(r.offset + r.bytes <= covered, Checkpoint,
                   "checkpoint: bytes [{}, {}) of {} lie past its checksummed blocks (its block "
                   "table starts at byte {})",
                   r.offset, r.offset + r.bytes, path.string(), covered);
  }
  std::vector<char> buffer;
  // Reads stay sorted by offset: a read a run finishes only partly continues at the run's end,
  // where no later read starts before it. Finished reads have no bytes left and are skipped.
  size_t next = 0;
  while (next < reads.size()) {
    if (reads[next].bytes == 0) {
      ++next;
      continue;
    }
    // The run of consecutive blocks the next reads touch, up to kBlocksPerRead.
    const int64_t first = reads[next].offset / B;
    int64_t last = (reads[next].offset + reads[next].bytes - 1) / B;
    for (size_t k = next + 1; k < reads.size(); ++k) {
      if (reads[k].bytes == 0) continue;
      if (reads[k].offset / B > last + 1) break;
      last = std::max(last, (reads[k].offset + reads[k].bytes - 1) / B);
    }
    last = std::min({last, first + kBlocksPerRead - 1, blocks - 1});
    const int64_t begin = first * B, end = std::min((last + 1) * B, covered);
    buffer.resize(static_cast<size_t>(end - begin));
    read_at(fd.fd, path, begin, end - begin, buffer.data());
    read_bytes_total += end - begin;
    for (int64_t b = first; b <= last; ++b) {
      const int64_t lo = b * B - begin, n = std::min(B, covered - b * B);
      const uint32_t crc = checksum_of(f.checksum, buffer.data() + lo, n);
      SHARDOPT_CHECK(crc == block_crcs[b], Checkpoint,
                     "checkpoint: checksum mismatch in shard file {}, bytes [{}, {}): {} is {}, "
                     "the {} says {}; the file is corrupt",
                     path.string(), b * B, b * B + n, checksum_name(f.checksum), crc_text(crc),
                     f.block_table_offset >= 0 ? "block table" : "manifest",
                     crc_text(block_crcs[b]));
    }
    // Copy what lies in [begin, end); a read reaching past it continues in the next run.
    for (size_t k = next; k < reads.size() && (reads[k].bytes == 0 || reads[k].offset < end); ++k) {
      RangeRead& r = reads[k];
      if (r.bytes == 0) continue;
      const int64_t take = std::min(r.bytes, end - r.offset);
      std::memcpy(r.dst, buffer.data() + (r.offset - begin), static_cast<size_t>(take));
      r.offset += take, r.bytes -= take, r.dst += take;
    }
  }
  return read_bytes_total;
}

}  // namespace shardopt::detail
