// Slot files of in-memory snapshots (snapshot_slot.hpp); their CRC-32C is crc32c.cpp's.
#include "checkpoint/snapshot_slot.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "shardopt/error.hpp"

namespace shardopt::detail {

namespace {

constexpr char kSlotMagic[8] = {'S', 'H', 'S', 'N', 'A', 'P', '0', '1'};

void put64(uint8_t* at, int64_t v) { std::memcpy(at, &v, 8); }
int64_t get64(const uint8_t* at) {
  int64_t v;
  std::memcpy(&v, at, 8);
  return v;
}
void put32(uint8_t* at, uint32_t v) { std::memcpy(at, &v, 4); }
uint32_t get32(const uint8_t* at) {
  uint32_t v;
  std::memcpy(&v, at, 4);
  return v;
}

[[noreturn]] void fail(const std::string& what, const std::string& path) {
  SHARDOPT_FAIL(Checkpoint, "snapshot: {} {}: {}", what, path, std::strerror(errno));
}

}  // namespace

PayloadChecksum::PayloadChecksum(uint8_t* payload, int64_t payload_bytes)
    : payload_(payload), n_(payload_bytes), q_(payload_bytes / 4 / 8 * 8) {}

void PayloadChecksum::copy(int64_t at, const void* src, int64_t n) {
  SHARDOPT_INTERNAL_ASSERT(at >= 0 && n >= 0 && at + n <= n_, "snapshot: piece [{}, {}) outside "
                           "a payload of {} bytes", at, at + n, n_);
  const auto* from = static_cast<const uint8_t*>(src);
  while (n > 0) {  // split at the quarters' bounds: each quarter has its own CRC
    const int64_t quarter = std::min<int64_t>(q_ > 0 ? at / q_ : 3, 3);
    const int64_t end = quarter < 3 ? (quarter + 1) * q_ : n_;
    const int64_t len = std::min(n, end - at);
    pieces_.push_back({at, len, crc32c_copy_register(payload_ + at, from, len)});
    at += len;
    from += len;
    n -= len;
  }
}

std::array<uint32_t, 4> PayloadChecksum::finish() {
  std::sort(pieces_.begin(), pieces_.end(),
            [](const Piece& x, const Piece& y) { return x.at < y.at; });
  std::array<uint32_t, 4> out{};
  size_t next = 0;
  for (int k = 0; k < 4; ++k) {
    const int64_t begin = k * q_, end = k < 3 ? (k + 1) * q_ : n_;
    uint32_t reg = ~0u;
    int64_t at = begin;
    auto gap = [&](int64_t upto) {  // bytes no piece wrote: read from the payload
      if (upto > at) {
        reg = crc32c_combine(reg, crc32c_register(payload_ + at, upto - at), upto - at);
      }
      at = std::max(at, upto);
    };
    for (; next < pieces_.size() && pieces_[next].at < end; ++next) {
      const Piece& p = pieces_[next];
      SHARDOPT_INTERNAL_ASSERT(p.at >= at, "snapshot: payload pieces overlap at byte {}", p.at);
      gap(p.at);
      reg = crc32c_combine(reg, p.crc, p.n);
      at = p.at + p.n;
    }
    gap(end);
    out[static_cast<size_t>(k)] = ~reg;
  }
  pieces_.clear();
  return out;
}

std::array<uint8_t, kSlotPrefixBytes> encode_prefix(const SlotPrefix& p) {
  std::array<uint8_t, kSlotPrefixBytes> b{};
  std::memcpy(b.data(), kSlotMagic, 8);
  put64(b.data() + 8, p.number);
  put64(b.data() + 16, p.payload_bytes);
  put64(b.data() + 24, p.tail_bytes);
  put64(b.data() + 32, p.json_bytes);
  for (int k = 0; k < 4; ++k) put32(b.data() + 40 + 4 * k, p.payload_crc[static_cast<size_t>(k)]);
  put32(b.data() + 56, p.tail_crc);
  put32(b.data() + 60, crc32c(b.data(), 60));
  return b;
}

std::optional<SlotPrefix> decode_prefix(const uint8_t* b) {
  if (std::memcmp(b, kSlotMagic, 8) != 0 || get32(b + 60) != crc32c(b, 60)) return std::nullopt;
  SlotPrefix p;
  p.number = get64(b + 8);
  p.payload_bytes = get64(b + 16);
  p.tail_bytes = get64(b + 24);
  p.json_bytes = get64(b + 32);
  for (int k = 0; k < 4; ++k) p.payload_crc[static_cast<size_t>(k)] = get32(b + 40 + 4 * k);
  p.tail_crc = get32(b + 56);
  const bool sane = p.number >= 0 && p.payload_bytes >= 0 && p.tail_bytes >= 0 &&
                    p.json_bytes >= 0 && p.json_bytes <= p.tail_bytes;
  if (!sane) return std::nullopt;
  return p;
}

SlotFile::~SlotFile() {
  unmap();
  if (fd_ >= 0) ::close(fd_);
}

void SlotFile::unmap() {
  if (base_ != nullptr) ::munmap(base_, static_cast<size_t>(kSlotPrefixBytes + payload_bytes_));
  base_ = nullptr;
  payload_bytes_ = -1;
}

uint8_t* SlotFile::map(int64_t payload_bytes) {
  if (base_ != nullptr && payload_bytes == payload_bytes_) return payload();
  unmap();
  if (fd_ < 0) {
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd_ < 0) fail("cannot open", path_);
  }
  const int64_t bytes = kSlotPrefixBytes + payload_bytes;
  // Grown, never cut (a record's tail lies beyond); the memory reserved now: a write into a mapped
  // page that a full tmpfs cannot back is a SIGBUS.
  struct stat st {};
  if (::fstat(fd_, &st) != 0) fail("cannot stat", path_);
  if (st.st_size < bytes && ::ftruncate(fd_, bytes) != 0) fail("cannot size", path_);
  if (const int e = ::posix_fallocate(fd_, 0, bytes); e != 0) {
    errno = e;
    fail("no room (is the tmpfs full?) for", path_);
  }
  void* m = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (m == MAP_FAILED) fail("cannot map", path_);
  base_ = static_cast<uint8_t*>(m);
  payload_bytes_ = payload_bytes;
  return payload();
}

void SlotFile::invalidate() {
  SlotPrefix p;  // number -1: encode_prefix keeps it, decode_prefix refuses it
  const auto b = encode_prefix(p);
  std::memcpy(base_, b.data(), b.size());
}

void SlotFile::write_tail(const std::string& tail) {
  const int64_t at = kSlotPrefixBytes + payload_bytes_;
  int64_t done = 0;
  while (done < static_cast<int64_t>(tail.size())) {
    const ssize_t n = ::pwrite(fd_, tail.data() + done, tail.size() - static_cast<size_t>(done),
                               static_cast<off_t>(at + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail("cannot write the tail of", path_);
    done += n;
  }
  if (::ftruncate(fd_, at + done) != 0) fail("cannot trim", path_);
}

void SlotFile::write_prefix(const std::array<uint8_t, kSlotPrefixBytes>& prefix) {
  std::memcpy(base_, prefix.data(), prefix.size());
}

std::optional<SlotPrefix> SlotFile::read_prefix() const {
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  uint8_t b[kSlotPrefixBytes];
  const ssize_t n = ::pread(fd, b, sizeof b, 0);
  struct stat st {};
  const bool whole = n == static_cast<ssize_t>(sizeof b) && ::fstat(fd, &st) == 0;
  ::close(fd);
  if (!whole) return std::nullopt;
  auto p = decode_prefix(b);
  if (p && st.st_size != kSlotPrefixBytes + p->payload_bytes + p->tail_bytes) return std::nullopt;
  return p;
}

std::string SlotFile::read_tail(const SlotPrefix& p) const {
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open", path_);
  std::string tail(static_cast<size_t>(p.tail_bytes), '\0');
  int64_t done = 0;
  while (done < p.tail_bytes) {
    const ssize_t n = ::pread(fd, tail.data() + done, static_cast<size_t>(p.tail_bytes - done),
                              static_cast<off_t>(kSlotPrefixBytes + p.payload_bytes + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      fail("cannot read the tail of", path_);
    }
    done += n;
  }
  ::close(fd);
  return tail;
}

bool tmpfs_without_huge_pages(const std::string& path, std::istream& mounts) {
  std::string line, best_point, best_type, best_options;
  while (std::getline(mounts, line)) {
    std::istringstream fields(line);
    std::string device, point, type, options;
    if (!(fields >> device >> point >> type >> options)) continue;
    const bool under = path == point || point == "/" ||
                       (path.compare(0, point.size(), point) == 0 && path[point.size()] == '/');
    if (under && point.size() >= best_point.size()) {
      best_point = point, best_type = type, best_options = "," + options + ",";
    }
  }
  return best_type == "tmpfs" && best_options.find(",huge=always,") == std::string::npos &&
         best_options.find(",huge=within_size,") == std::string::npos;
}

bool tmpfs_without_huge_pages(const std::string& dir) {
  std::error_code ec;
  const std::string path = std::filesystem::canonical(dir, ec).string();
  std::ifstream mounts("/proc/mounts");
  return !ec && mounts && tmpfs_without_huge_pages(path, mounts);
}

}  // namespace shardopt::detail
