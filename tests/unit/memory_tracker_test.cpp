// MemoryTracker: exact byte deltas and peaks of CPU tensor storage, storage that outlives or
// predates installation, the raw allocator interface and nesting.
#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "shardopt/error.hpp"
#include "shardopt/memory_tracker.hpp"

namespace shardopt {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

at::Tensor floats(int64_t n) { return at::empty({n}, at::kFloat); }

TEST(MemoryTracker, CountsExactBytesOfLiveStorage) {
  ScopedMemoryTracking tracking;
  auto& t = tracking.tracker();
  ASSERT_TRUE(t.installed());
  const int64_t base = t.live_bytes();
  const int64_t base_allocations = t.live_allocations();
  {
    at::Tensor a = floats(1000);
    EXPECT_EQ(t.live_bytes() - base, 4000);
    at::Tensor b = at::empty({3, 7}, at::kDouble);
    EXPECT_EQ(t.live_bytes() - base, 4000 + 21 * 8);
    EXPECT_EQ(t.live_allocations() - base_allocations, 2);
    at::Tensor view = a.narrow(0, 10, 100);  // a view: no storage of its own
    EXPECT_EQ(t.live_bytes() - base, 4000 + 21 * 8);
    at::Tensor sum = a + a;  // one output
    EXPECT_EQ(t.live_bytes() - base, 2 * 4000 + 21 * 8);
  }
  EXPECT_EQ(t.live_bytes(), base);
  EXPECT_EQ(t.live_allocations(), base_allocations);
}

TEST(MemoryTracker, ZeroSizedTensorsCostNothing) {
  ScopedMemoryTracking tracking;
  auto& t = tracking.tracker();
  const int64_t base = t.live_bytes(), total = t.total_allocations();
  at::Tensor e = floats(0);
  EXPECT_EQ(t.live_bytes(), base);
  EXPECT_EQ(t.total_allocations(), total);
}

TEST(MemoryTracker, PeakFollowsTheHighestLiveTotal) {
  ScopedMemoryTracking tracking;
  auto& t = tracking.tracker();
  const int64_t base = t.live_bytes();
  EXPECT_EQ(t.peak_bytes(), base);  // the window starts at construction
  at::Tensor one = floats(kMiB / 4);  // 1 MiB
  at::Tensor two = floats(kMiB / 2);  // 2 MiB
  one.reset();
  at::Tensor half = floats(kMiB / 8);  // 0.5 MiB
  EXPECT_EQ(t.live_bytes() - base, 2 * kMiB + kMiB / 2);
  EXPECT_EQ(t.peak_bytes() - base, 3 * kMiB);

  // A new window starts at the current live bytes and returns the old peak.
  EXPECT_EQ(t.reset_peak() - base, 3 * kMiB);
  EXPECT_EQ(t.peak_bytes() - base, 2 * kMiB + kMiB / 2);
  two.reset();
  EXPECT_EQ(t.peak_bytes() - base, 2 * kMiB + kMiB / 2);
  at::Tensor four = floats(kMiB);  // 4 MiB on top of 0.5
  EXPECT_EQ(t.peak_bytes() - base, 4 * kMiB + kMiB / 2);
}

// Note [Peak attribution]: the bytes by (category, owner) at the peak of the window.
TEST(MemoryTracker, PeakReportSaysWhereTheBytesWereAtThePeak) {
  ScopedMemoryTracking tracking;
  auto& t = tracking.tracker();
  at::Tensor a, b, inner;
  {
    MemoryScope scope("test shards", "owner a");
    a = floats(kMiB / 4);  // 1 MiB
    {
      MemoryScope nested("test parts", "part 1");  // the innermost scope wins
      inner = floats(kMiB / 16);  // 0.25 MiB
    }
    b = floats(kMiB / 2);  // 2 MiB, still "test shards": the peak
  }
  b.reset();
  at::Tensor c = floats(kMiB / 8);  // 0.5 MiB of "other" after the peak
  MemoryPeakReport r = t.peak_report();
  EXPECT_EQ(r.bytes_of("test shards"), 3 * kMiB);
  EXPECT_EQ(r.bytes_of("test parts"), kMiB / 4);
  EXPECT_EQ(r.peak_bytes, t.peak_bytes());
  ASSERT_FALSE(r.entries.empty());
  EXPECT_EQ(r.entries.front().owner, "owner a");  // largest first
  EXPECT_NE(r.to_string().find("test parts (part 1)"), std::string::npos);
  t.reset_peak();  // a new window: where the bytes are now
  r = t.peak_report();
  EXPECT_EQ(r.bytes_of("test shards"), kMiB);
  EXPECT_EQ(r.peak_bytes, t.live_bytes());
}

TEST(MemoryTracker, StoragePredatingInstallationIsFreedOutsideTheCounts) {
  auto& t = MemoryTracker::cpu();
  at::Tensor before = floats(kMiB);  // through the original allocator
  at::Tensor tracked;
  int64_t base = 0;
  {
    ScopedMemoryTracking tracking;
    base = t.live_bytes();
    tracked = floats(1024);
    EXPECT_EQ(t.live_bytes() - base, 4096);
    before.reset();  // original deleter: the counts must not move
    EXPECT_EQ(t.live_bytes() - base, 4096);
    before = at::ones({16});  // fresh storage for the old handle is ours
    EXPECT_EQ(t.live_bytes() - base, 4096 + 64);
  }
  EXPECT_FALSE(t.installed());
  // Allocated while installed, freed after: still leaves the counts.
  EXPECT_EQ(t.live_bytes() - base, 4096 + 64);
  tracked.reset();
  before.reset();
  EXPECT_EQ(t.live_bytes(), base);
  // Not installed: new storage is not counted.
  at::Tensor untracked = floats(kMiB);
  EXPECT_EQ(t.live_bytes(), base);
}

TEST(MemoryTracker, ResizeOfTrackedStorageIsCounted) {
  ScopedMemoryTracking tracking;
  auto& t = tracking.tracker();
  const int64_t base = t.live_bytes();
  at::Tensor a = floats(10);
  a.resize_({1000});  // reallocates through the storage's allocator (ours), frees the old block
  EXPECT_EQ(t.live_bytes() - base, 4000);
  a.reset();
  EXPECT_EQ(t.live_bytes(), base);
}

TEST(MemoryTracker, RawInterfaceWorks) {
  ScopedMemoryTracking tracking;
  auto& t = tracking.tracker();
  const int64_t base = t.live_bytes();
  c10::Allocator* alloc = c10::GetAllocator(c10::DeviceType::CPU);
  ASSERT_NE(alloc->raw_deleter(), nullptr);
  void* p = alloc->raw_allocate(12345);
  ASSERT_NE(p, nullptr);
  static_cast<char*>(p)[12344] = 1;
  EXPECT_EQ(t.live_bytes() - base, 12345);
  alloc->raw_deallocate(p);
  EXPECT_EQ(t.live_bytes(), base);
}

TEST(MemoryTracker, NestedInstallationKeepsTheTrackerUntilTheLastExit) {
  auto& t = MemoryTracker::cpu();
  c10::Allocator* original = c10::GetAllocator(c10::DeviceType::CPU);
  {
    ScopedMemoryTracking outer;
    {
      ScopedMemoryTracking inner;
      EXPECT_TRUE(t.installed());
    }
    EXPECT_TRUE(t.installed());
    const int64_t base = t.live_bytes();
    at::Tensor a = floats(256);
    EXPECT_EQ(t.live_bytes() - base, 1024);
  }
  EXPECT_FALSE(t.installed());
  EXPECT_EQ(c10::GetAllocator(c10::DeviceType::CPU), original);
}

TEST(MemoryTracker, ManyAllocationsBalance) {
  ScopedMemoryTracking tracking;
  auto& t = tracking.tracker();
  const int64_t base = t.live_bytes();
  std::vector<at::Tensor> keep;
  int64_t expected = 0;
  for (int64_t i = 1; i <= 200; ++i) {
    keep.push_back(at::empty({i * 3}, at::kFloat));
    expected += i * 12;
  }
  EXPECT_EQ(t.live_bytes() - base, expected);
  EXPECT_EQ(t.peak_bytes() - base, expected);
  for (size_t i = 0; i < keep.size(); i += 2) {
    expected -= keep[i].nbytes();
    keep[i].reset();
  }
  EXPECT_EQ(t.live_bytes() - base, expected);
  keep.clear();
  EXPECT_EQ(t.live_bytes(), base);
}

TEST(MemoryTracker, UninstallWithoutInstallIsAnError) {
  EXPECT_THROW(MemoryTracker::cpu().uninstall(), std::exception);
}

// Note [Memory cap]: a request over the cap is refused with OutOfMemory, allocates nothing and
// leaves the counts as they were; under the cap, allocation goes on; 0 lifts the cap.
TEST(MemoryTracker, CapRefusesAllocationsOverItAndCountsNothing) {
  ScopedMemoryTracking tracking;
  auto& t = tracking.tracker();
  const int64_t base = t.live_bytes(), total = t.total_allocations();
  t.set_limit(base + 2 * kMiB);
  at::Tensor a = floats(kMiB / 4);  // 1 MiB: fits
  try {
    at::Tensor b = floats(kMiB / 2);  // 2 MiB more: 3 MiB over a 2 MiB cap
    ADD_FAILURE() << "allocation over the cap was not refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::OutOfMemory);
    const std::string what = e.what();
    EXPECT_NE(what.find("out of memory"), std::string::npos) << what;
    EXPECT_NE(what.find(fmt::format("({} bytes)", 2 * kMiB)), std::string::npos) << what;
    EXPECT_NE(what.find(fmt::format("cap of {:.1f} MB", (base + 2 * kMiB) / 1e6)),
              std::string::npos) << what;
  }
  EXPECT_EQ(t.live_bytes(), base + kMiB);
  EXPECT_EQ(t.total_allocations(), total + 1);
  at::Tensor c = floats(kMiB / 4);  // exactly at the cap: allowed
  EXPECT_EQ(t.live_bytes(), base + 2 * kMiB);
  EXPECT_THROW(t.set_limit(-1), Error);
  t.set_limit(0);
  at::Tensor d = floats(kMiB);
  EXPECT_EQ(t.live_bytes(), base + 6 * kMiB);
  EXPECT_EQ(t.limit(), 0);
}

}  // namespace
}  // namespace shardopt
