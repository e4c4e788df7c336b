// The checksum of an in-memory snapshot's payload written in pieces (checkpoint/snapshot_slot.hpp):
// PayloadChecksum must give crc32c_quarters' values for any order of pieces, with gaps, pieces
// across the quarters' bounds and lengths that are not multiples of 8; and which slot directories
// are on a tmpfs without huge pages (Note [Huge pages for the slots]).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <sstream>
#include <vector>

#include "checkpoint/snapshot_slot.hpp"

namespace {

using shardopt::detail::crc32c_quarters;
using shardopt::detail::PayloadChecksum;

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(gen());
  return v;
}

TEST(PayloadChecksum, EqualsTheQuartersForPiecesInAnyOrder) {
  for (const int64_t n : {int64_t{0}, int64_t{5}, int64_t{31}, int64_t{32}, int64_t{1000},
                          int64_t{300001}, int64_t{4 * 65536 + 77}, int64_t{3 << 20}}) {
    const auto src = random_bytes(static_cast<size_t>(n), static_cast<uint32_t>(n));
    std::mt19937 gen(7);
    // Cut [0, n) at random points; every third piece is left out (a gap the payload holds).
    std::vector<int64_t> cuts = {0, n};
    for (int i = 0; i < 9 && n > 0; ++i) {
      cuts.push_back(static_cast<int64_t>(gen() % static_cast<uint32_t>(n)));
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::vector<size_t> order(cuts.size() - 1);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), gen);
    std::vector<uint8_t> payload = random_bytes(static_cast<size_t>(n), 99);  // stale bytes
    PayloadChecksum sum(payload.data(), n);
    for (size_t i : order) {
      if (i % 3 == 2) continue;
      sum.copy(cuts[i], src.data() + cuts[i], cuts[i + 1] - cuts[i]);
    }
    const auto got = sum.finish();
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {  // the copied pieces landed
      if (i % 3 == 2) continue;
      ASSERT_TRUE(std::equal(src.begin() + cuts[i], src.begin() + cuts[i + 1],
                             payload.begin() + cuts[i]))
          << "n " << n << " piece " << i;
    }
    EXPECT_EQ(got, crc32c_quarters(payload.data(), n)) << "payload of " << n << " bytes";
  }
}

TEST(PayloadChecksum, ChangesWithAnyByte) {
  const int64_t n = 200000;
  const auto src = random_bytes(static_cast<size_t>(n), 1);
  std::vector<uint8_t> payload(static_cast<size_t>(n));
  PayloadChecksum sum(payload.data(), n);
  sum.copy(0, src.data(), n);
  const auto clean = sum.finish();
  for (const int64_t at : {int64_t{0}, n / 4 + 3, n - 1}) {
    auto flipped = src;
    flipped[static_cast<size_t>(at)] ^= 0x10;
    PayloadChecksum again(payload.data(), n);
    again.copy(0, flipped.data(), n);
    EXPECT_NE(again.finish(), clean) << "byte " << at;
  }
}

// The mount that holds a directory is the longest mount point on its path; only tmpfs without
// huge=within_size or huge=always is reported.
TEST(SlotDirectory, TmpfsWithoutHugePagesByTheLongestMountPoint) {
  const std::string mounts =
      "/dev/vda / ext4 rw,relatime 0 0\n"
      "tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0\n"
      "tmpfs /dev/shm/huge tmpfs rw,relatime,huge=within_size 0 0\n"
      "tmpfs /mnt/always tmpfs rw,size=1g,huge=always,mode=755 0 0\n"
      "tmpfs /mnt/never tmpfs rw,huge=never 0 0\n"
      "proc /proc proc rw 0 0\n";
  const auto without = [&](const std::string& path) {
    std::istringstream in(mounts);
    return shardopt::detail::tmpfs_without_huge_pages(path, in);
  };
  EXPECT_TRUE(without("/dev/shm"));
  EXPECT_TRUE(without("/dev/shm/job"));
  EXPECT_FALSE(without("/dev/shm/huge"));
  EXPECT_FALSE(without("/dev/shm/huge/job"));
  EXPECT_TRUE(without("/dev/shm/hugepages")) << "a name that only starts like a mount point";
  EXPECT_FALSE(without("/mnt/always/job"));
  EXPECT_TRUE(without("/mnt/never/job"));
  EXPECT_FALSE(without("/tmp/job")) << "ext4";
  EXPECT_FALSE(without("/proc/self"));
  EXPECT_FALSE(shardopt::detail::tmpfs_without_huge_pages("/no/such/directory"));
}

}  // namespace
