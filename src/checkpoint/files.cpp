// Checkpoint files: paths of a save, the checksumming writer, fsync, whole-file reads, CRC-32,
// and atomic publication (tmp + rename; RENAME_EXCHANGE for directories).
#include "checkpoint/files.hpp"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <ftw.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "checkpoint/crc32c.hpp"
#include "checkpoint/format.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail {

namespace fs = std::filesystem;

Paths paths_of(const std::string& dir) {
  SHARDOPT_CHECK(!dir.empty(), InvalidArgument, "checkpoint: the directory name is empty");
  fs::path d = fs::path(dir).lexically_normal();
  if (d.filename().empty()) d = d.parent_path();  // "out/ckpt/"
  const std::string name = d.filename().string();
  SHARDOPT_CHECK(!name.empty() && name != "." && name != "..", InvalidArgument,
                 "checkpoint: '{}' does not name a directory that can be replaced; give a path "
                 "such as out/checkpoint",
                 dir);
  Paths p;
  p.dir = d;
  p.parent = d.has_parent_path() ? d.parent_path() : fs::path(".");
  p.tmp = p.parent / ("." + name + ".tmp");
  p.old = p.parent / ("." + name + ".old");
  return p;
}

void remove_tree(const fs::path& path, std::error_code& ec) {
  ec.clear();
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno != ENOENT) ec.assign(errno, std::generic_category());
    return;
  }
  // Depth first (children before their directory), not following symbolic links.
  const int rc = ::nftw(
      path.c_str(),
      [](const char* name, const struct stat*, int, struct FTW*) { return ::remove(name); }, 16,
      FTW_DEPTH | FTW_PHYS);
  if (rc != 0) ec.assign(errno ? errno : EIO, std::generic_category());
}

std::string shard_file_name(int rank, int world) {
  return fmt::format("shard-{:05d}-of-{:05d}.bin", rank, world);
}

std::string errno_text() { return std::strerror(errno); }

namespace {
constexpr size_t kPage = 4096;  // O_DIRECT's alignment of addresses, offsets and lengths
}  // namespace

void FileWriter::FreeAligned::operator()(unsigned char* p) const { std::free(p); }

FileWriter::FileWriter(fs::path path, bool direct) : path_(std::move(path)) {
  constexpr int kFlags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
#ifdef O_DIRECT
  if (direct) {  // Note [Direct shard writes]
    fd_ = ::open(path_.c_str(), kFlags | O_DIRECT, 0644);
    void* buffer = nullptr;
    if (fd_ >= 0 && ::posix_memalign(&buffer, kPage, kDirectStaging) == 0) {
      staging_.reset(static_cast<unsigned char*>(buffer));
      return;
    }
    if (fd_ >= 0) ::close(fd_);  // no staging buffer: buffered after all
  }
#else
  (void)direct;
#endif
  fd_ = ::open(path_.c_str(), kFlags, 0644);
  SHARDOPT_CHECK(fd_ >= 0, Checkpoint, "checkpoint: cannot create {}: {}", path_.string(),
                 errno_text());
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void FileWriter::write_out(const unsigned char* p, size_t bytes) {
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::write(fd_, p + done, bytes - done);
    if (n < 0 && errno == EINTR) continue;
    SHARDOPT_CHECK(n > 0, Checkpoint, "checkpoint: writing {} failed after {} bytes: {}",
                   path_.string(), bytes_ - static_cast<int64_t>(staged_) + done, errno_text());
    done += static_cast<size_t>(n);
  }
}

// Writes the first `bytes` of the staging buffer (a multiple of kPage) and empties it.
void FileWriter::flush_staging(size_t bytes) {
  write_out(staging_.get(), bytes);
  staged_ = 0;
}

namespace {
// Folding a whole block's CRC-32C into the file's: a table, not a multiplication per block.
const Crc32cShift& block_shift() {
  static const Crc32cShift shift(kBlockBytes);
  return shift;
}
}  // namespace

void FileWriter::add_blocks(size_t first) {
  const Crc32cShift& shift = block_shift();
  for (size_t b = first; b < blocks_.size(); ++b) crc_ = shift.combine(crc_, blocks_[b]);
}

void FileWriter::write(const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t at = 0; at < bytes;) {  // Note [Block checksums]
    const int64_t in_block = (bytes_ + static_cast<int64_t>(at)) % kBlockBytes;
    const auto whole = static_cast<int64_t>((bytes - at) / kBlockBytes);
    if (in_block == 0 && whole > 0) {  // whole blocks: four checksummed at a time
      const size_t first = blocks_.size();
      blocks_.resize(first + static_cast<size_t>(whole));
      crc32c_blocks(nullptr, p + at, whole, kBlockBytes, blocks_.data() + first);
      add_blocks(first);
      at += static_cast<size_t>(whole * kBlockBytes);
      continue;
    }
    const size_t take = std::min(bytes - at, static_cast<size_t>(kBlockBytes - in_block));
    block_crc_ = crc32c_extend(block_crc_, p + at, static_cast<int64_t>(take));
    at += take;
    if (in_block + static_cast<int64_t>(take) == kBlockBytes) {
      blocks_.push_back(block_crc_);
      add_blocks(blocks_.size() - 1);
      block_crc_ = 0;
    }
  }
  put(p, bytes);
}

// The bytes themselves: to the file, or through the staging buffer.
void FileWriter::put(const unsigned char* p, size_t bytes) {
  if (!staging_) {
    write_out(p, bytes);
    bytes_ += static_cast<int64_t>(bytes);
    return;
  }
  for (size_t at = 0; at < bytes;) {  // whole staging buffers: offsets stay page-aligned
    const size_t take = std::min(bytes - at, kDirectStaging - staged_);
    std::memcpy(staging_.get() + staged_, p + at, take);
    staged_ += take;
    at += take;
    bytes_ += static_cast<int64_t>(take);
    if (staged_ == kDirectStaging) flush_staging(kDirectStaging);
  }
}

void FileWriter::write_blocks(const void* data, size_t bytes, const uint32_t* block_crcs) {
  SHARDOPT_INTERNAL_ASSERT(bytes_ % kBlockBytes == 0 && bytes % kBlockBytes == 0,
                           "checkpoint: {} bytes of known blocks at byte {} of {}", bytes, bytes_,
                           path_.string());
  const size_t first = blocks_.size();
  blocks_.insert(blocks_.end(), block_crcs, block_crcs + bytes / kBlockBytes);
  add_blocks(first);
  const auto* p = static_cast<const unsigned char*>(data);
  if (staging_ && reinterpret_cast<uintptr_t>(p) % kPage == 0) {
    // The disk reads the snapshot itself (Note [Shard images]). What is staged is whole pages
    // (bytes_ is on a block boundary), so offsets stay page-aligned.
    if (staged_ > 0) flush_staging(staged_);
    write_out(p, bytes);
    bytes_ += static_cast<int64_t>(bytes);
    return;
  }
  put(p, bytes);
}

uint32_t FileWriter::crc() const {
  const int64_t partial = bytes_ % kBlockBytes;
  return partial == 0 ? crc_ : crc32c_combine(crc_, block_crc_, partial);
}

std::vector<uint32_t> FileWriter::block_crcs() const {
  std::vector<uint32_t> out = blocks_;
  if (bytes_ % kBlockBytes != 0) out.push_back(block_crc_);
  return out;
}

void FileWriter::pad_to(int64_t alignment) {
  static const char zeros[kBlockBytes] = {};
  SHARDOPT_INTERNAL_ASSERT(alignment > 0 && alignment <= kBlockBytes,
                           "checkpoint: padding to {} bytes", alignment);
  const int64_t pad = (alignment - bytes_ % alignment) % alignment;
  if (pad > 0) write(zeros, static_cast<size_t>(pad));
}

void FileWriter::write_tensor(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU).contiguous();
  write(c.data_ptr(), c.nbytes());
}

void FileWriter::sync_and_close() {
  if (staging_ && staged_ > 0) {
    // The last partial page goes out zero-padded; the file is then cut to its length.
    const size_t padded = (staged_ + kPage - 1) / kPage * kPage;
    std::memset(staging_.get() + staged_, 0, padded - staged_);
    flush_staging(padded);
    SHARDOPT_CHECK(::ftruncate(fd_, static_cast<off_t>(bytes_)) == 0, Checkpoint,
                   "checkpoint: truncating {} to {} bytes failed: {}", path_.string(), bytes_,
                   errno_text());
  }
  SHARDOPT_CHECK(::fsync(fd_) == 0, Checkpoint, "checkpoint: fsync of {} failed: {}",
                 path_.string(), errno_text());
  const int fd = fd_;
  fd_ = -1;
  SHARDOPT_CHECK(::close(fd) == 0, Checkpoint, "checkpoint: closing {} failed: {}",
                 path_.string(), errno_text());
}


void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  SHARDOPT_CHECK(fd >= 0, Checkpoint, "checkpoint: cannot open directory {}: {}", dir.string(),
                 errno_text());
  const int rc = ::fsync(fd);
  const std::string err = rc == 0 ? "" : errno_text();
  ::close(fd);
  SHARDOPT_CHECK(rc == 0, Checkpoint, "checkpoint: fsync of directory {} failed: {}", dir.string(),
                 err);
}

at::Tensor read_bytes(const fs::path& path, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  SHARDOPT_CHECK(fd >= 0, Checkpoint, "checkpoint: {} {} cannot be read: {}", what, path.string(),
                 errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string err = errno_text();
    ::close(fd);
    SHARDOPT_FAIL(Checkpoint, "checkpoint: cannot stat {} {}: {}", what, path.string(), err);
  }
  at::Tensor bytes = at::empty({static_cast<int64_t>(st.st_size)}, at::kByte);
  auto* p = static_cast<char*>(bytes.data_ptr());
  size_t done = 0;
  while (done < static_cast<size_t>(st.st_size)) {
    const ssize_t n = ::read(fd, p + done, static_cast<size_t>(st.st_size) - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string err = n == 0 ? "unexpected end of file" : errno_text();
      ::close(fd);
      SHARDOPT_FAIL(Checkpoint, "checkpoint: reading {} {} failed: {}", what, path.string(), err);
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return bytes;
}

void read_at(int fd, const fs::path& path, int64_t offset, int64_t bytes, void* dst) {
  auto* p = static_cast<char*>(dst);
  int64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, p + done, static_cast<size_t>(bytes - done), offset + done);
    if (n < 0 && errno == EINTR) continue;
    SHARDOPT_CHECK(n > 0, Checkpoint, "checkpoint: reading {} bytes at byte {} of {} failed: {}",
                   bytes, offset + done, path.string(),
                   n == 0 ? std::string("unexpected end of file") : errno_text());
    done += n;
  }
}

std::string crc_text(uint32_t crc) { return fmt::format("{:08x}", crc); }

uint32_t checksum_of(ShardChecksum kind, const void* data, int64_t n) {
  if (kind == ShardChecksum::Crc32c) return crc32c(data, n);
  return static_cast<uint32_t>(crc32_z(crc32_z(0L, Z_NULL, 0),
                                       static_cast<const unsigned char*>(data),
                                       static_cast<size_t>(n)));
}

uint32_t crc_of(const at::Tensor& bytes) {
  return static_cast<uint32_t>(crc32_z(crc32_z(0L, Z_NULL, 0),
                                       static_cast<const unsigned char*>(bytes.data_ptr()),
                                       static_cast<size_t>(bytes.numel())));
}

void write_file_atomically(const fs::path& path, const void* data, size_t bytes) {
  const fs::path parent = path.has_parent_path() ? path.parent_path() : fs::path(".");
  std::error_code ec;
  fs::create_directories(parent, ec);
  SHARDOPT_CHECK(!ec, Checkpoint, "checkpoint: cannot create directory {}: {}", parent.string(),
                 ec.message());
  // Appended rather than "." + name: GCC 12 -O3 warns falsely on that insert (-Wstringop-overflow).
  std::string tmp_name = ".";
  tmp_name += path.filename().string();
  tmp_name += ".tmp";
  const fs::path tmp = parent / tmp_name;
  {
    FileWriter w(tmp);
    w.write(data, bytes);
    w.sync_and_close();
  }
  SHARDOPT_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, Checkpoint,
                 "checkpoint: cannot rename {} to {}: {}", tmp.string(), path.string(),
                 errno_text());
  fsync_dir(parent);
}

void publish(const Paths& p) {
  std::error_code ec;
  if (!fs::exists(p.dir, ec)) {
    SHARDOPT_CHECK(::rename(p.tmp.c_str(), p.dir.c_str()) == 0, Checkpoint,
                   "checkpoint: cannot rename {} to {}: {}", p.tmp.string(), p.dir.string(),
                   errno_text());
    fsync_dir(p.parent);
    return;
  }
  if (::renameat2(AT_FDCWD, p.tmp.c_str(), AT_FDCWD, p.dir.c_str(), RENAME_EXCHANGE) == 0) {
    fsync_dir(p.parent);
    remove_tree(p.tmp, ec);  // now the previous checkpoint
    return;
  }
  SHARDOPT_CHECK(errno == EINVAL || errno == ENOSYS || errno == ENOTSUP, Checkpoint,
                 "checkpoint: cannot exchange {} with {}: {}", p.tmp.string(), p.dir.string(),
                 errno_text());
  // No RENAME_EXCHANGE on this filesystem: a crash between these renames leaves the previous
  // checkpoint at .<name>.old, which load_checkpoint points to.
  remove_tree(p.old, ec);
  SHARDOPT_CHECK(::rename(p.dir.c_str(), p.old.c_str()) == 0, Checkpoint,
                 "checkpoint: cannot rename {} to {}: {}", p.dir.string(), p.old.string(),
                 errno_text());
  SHARDOPT_CHECK(::rename(p.tmp.c_str(), p.dir.c_str()) == 0, Checkpoint,
                 "checkpoint: cannot rename {} to {}: {}", p.tmp.string(), p.dir.string(),
                 errno_text());
  fsync_dir(p.parent);
  remove_tree(p.old, ec);
}

void prepare_tmp(const Paths& p) {
  std::error_code ec;
  fs::create_directories(p.parent, ec);
  SHARDOPT_CHECK(!ec, Checkpoint, "checkpoint: cannot create directory {}: {}", p.parent.string(),
                 ec.message());
  if (fs::exists(p.dir, ec)) {
    SHARDOPT_CHECK(fs::is_directory(p.dir, ec), Checkpoint,
                   "checkpoint: {} exists and is not a directory; refusing to replace it",
                   p.dir.string());
    SHARDOPT_CHECK(fs::exists(p.dir / kManifest, ec) || fs::is_empty(p.dir, ec), Checkpoint,
                   "checkpoint: {} exists and is not a shardopt checkpoint (no {}); refusing to "
                   "replace it",
                   p.dir.string(), kManifest);
  }
  remove_tree(p.tmp, ec);
  SHARDOPT_CHECK(!ec, Checkpoint, "checkpoint: cannot remove the leftover {}: {}", p.tmp.string(),
                 ec.message());
  fs::create_directory(p.tmp, ec);
  SHARDOPT_CHECK(!ec, Checkpoint, "checkpoint: cannot write to directory {} (creating {}): {}",
                 p.parent.string(), p.tmp.string(), ec.message());
}

}  // namespace shardopt::detail
