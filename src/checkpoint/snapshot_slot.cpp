// Slot files of in-memory snapshots (snapshot_slot.hpp) and their CRC-32C.
#include "checkpoint/snapshot_slot.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

#include "shardopt/error.hpp"

namespace shardopt::detail {

namespace {

constexpr char kSlotMagic[8] = {'S', 'H', 'S', 'N', 'A', 'P', '0', '1'};

struct Table {
  uint32_t v[256];
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      v[i] = c;
    }
  }
};

uint32_t crc_bytes_portable(uint32_t c, const uint8_t* p, int64_t n) {
  static const Table table;
  for (int64_t i = 0; i < n; ++i) c = table.v[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c;
}

void quarters_portable(const uint8_t* p, int64_t q, int64_t n, uint32_t c[4]) {
  for (int k = 0; k < 4; ++k) {
    const int64_t len = k < 3 ? q : n - 3 * q;
    c[k] = crc_bytes_portable(c[k], p + k * q, len);
  }
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) void quarters_sse42(const uint8_t* p, int64_t q, int64_t n,
                                                      uint32_t c[4]) {
  uint64_t s[4] = {c[0], c[1], c[2], c[3]};
  const uint8_t* at[4] = {p, p + q, p + 2 * q, p + 3 * q};
  int64_t i = 0;
  for (; i + 8 <= q; i += 8) {  // four streams: the instruction's latency hidden
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, at[k] + i, 8);
      s[k] = _mm_crc32_u64(s[k], w);
    }
  }
  for (int k = 0; k < 4; ++k) {
    const int64_t len = k < 3 ? q : n - 3 * q;
    auto c32 = static_cast<uint32_t>(s[k]);
    int64_t j = i;
    for (; j + 8 <= len; j += 8) {
      uint64_t w;
      std::memcpy(&w, at[k] + j, 8);
      c32 = static_cast<uint32_t>(_mm_crc32_u64(c32, w));
    }
    for (; j < len; ++j) c32 = _mm_crc32_u8(c32, at[k][j]);
    c[k] = c32;
  }
}
#endif

void quarters(const uint8_t* p, int64_t n, uint32_t c[4]) {
  const int64_t q = n / 4 / 8 * 8;
#if defined(__x86_64__)
  if (__builtin_cpu_supports("sse4.2")) return quarters_sse42(p, q, n, c);
#endif
  quarters_portable(p, q, n, c);
}

// ---- CRC-32C of pieces, combined (zlib's crc32_combine, for the Castagnoli polynomial) ----

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected

// a * b modulo the polynomial, bit-reflected (x^0 is the top bit).
uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(2^k) modulo the polynomial, k = 0..31.
struct PowersOfX {
  uint32_t v[32];
  PowersOfX() {
    uint32_t p = 1u << 30;  // x^1
    v[0] = p;
    for (int k = 1; k < 32; ++k) v[k] = p = multmodp(p, p);
  }
};

// x^(8 n) modulo the polynomial: multiplying a CRC register by it feeds it n zero bytes.
uint32_t x8n(int64_t n) {
  static const PowersOfX powers;
  uint32_t p = 1u << 31;  // x^0
  for (unsigned k = 3; n != 0; n >>= 1, ++k) {
    if (n & 1) p = multmodp(powers.v[k & 31], p);
  }
  return p;
}

// The register over A then B, from A's register and B's register from 0.
uint32_t combine(uint32_t a, uint32_t b_from_zero, int64_t b_bytes) {
  return multmodp(x8n(b_bytes), a) ^ b_from_zero;
}

// Copies n bytes while computing their CRC register from 0: four lanes of kLane bytes at a time
// keep the CRC instruction's latency hidden, so the pass runs at the memory's speed.
constexpr int64_t kLane = 16 << 10;

uint32_t copy_crc_portable(uint8_t* dst, const uint8_t* src, int64_t n) {
  std::memcpy(dst, src, static_cast<size_t>(n));
  return crc_bytes_portable(0, dst, n);
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t copy_crc_sse42(uint8_t* dst, const uint8_t* src,
                                                          int64_t n) {
  static const uint32_t lane_shift = x8n(kLane);
  uint32_t crc = 0;
  int64_t i = 0;
  for (; i + 4 * kLane <= n; i += 4 * kLane) {
    uint64_t s[4] = {0, 0, 0, 0};
    const uint8_t* from = src + i;
    uint8_t* to = dst + i;
    for (int64_t j = 0; j < kLane; j += 8) {
      for (int k = 0; k < 4; ++k) {
        uint64_t w;
        std::memcpy(&w, from + k * kLane + j, 8);
        s[k] = _mm_crc32_u64(s[k], w);
        std::memcpy(to + k * kLane + j, &w, 8);
      }
    }
    for (int k = 0; k < 4; ++k) crc = multmodp(lane_shift, crc) ^ static_cast<uint32_t>(s[k]);
  }
  uint64_t c = crc;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, src + i, 8);
    c = _mm_crc32_u64(c, w);
    std::memcpy(dst + i, &w, 8);
  }
  auto c32 = static_cast<uint32_t>(c);
  for (; i < n; ++i) {
    dst[i] = src[i];
    c32 = _mm_crc32_u8(c32, src[i]);
  }
  return c32;
}
#endif

uint32_t copy_crc(uint8_t* dst, const uint8_t* src, int64_t n) {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("sse4.2")) return copy_crc_sse42(dst, src, n);
#endif
  return copy_crc_portable(dst, src, n);
}

// The CRC register over [p, p + n) from 0 (gaps between pieces: rare, small).
uint32_t crc_from_zero(const uint8_t* p, int64_t n) {
  uint32_t c[4] = {0, 0, 0, 0};
  if (n < 64) return crc_bytes_portable(0, p, n);
  const int64_t q = n / 4 / 8 * 8;
  quarters(p, n, c);
  const int64_t last = n - 3 * q;
  return combine(combine(combine(c[0], c[1], q), c[2], q), c[3], last);
}

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

std::array<uint32_t, 4> crc32c_quarters(const void* data, int64_t n) {
  uint32_t c[4] = {~0u, ~0u, ~0u, ~0u};
  quarters(static_cast<const uint8_t*>(data), n, c);
  return {~c[0], ~c[1], ~c[2], ~c[3]};
}

uint32_t crc32c(const void* data, int64_t n) {
  return ~crc_bytes_portable(~0u, static_cast<const uint8_t*>(data), n);
}

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
    pieces_.push_back({at, len, copy_crc(payload_ + at, from, len)});
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
      if (upto > at) reg = combine(reg, crc_from_zero(payload_ + at, upto - at), upto - at);
      at = std::max(at, upto);
    };
    for (; next < pieces_.size() && pieces_[next].at < end; ++next) {
      const Piece& p = pieces_[next];
      SHARDOPT_INTERNAL_ASSERT(p.at >= at, "snapshot: payload pieces overlap at byte {}", p.at);
      gap(p.at);
      reg = combine(reg, p.crc, p.n);
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

}  // namespace shardopt::detail
