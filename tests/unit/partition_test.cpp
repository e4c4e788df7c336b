// FlatLayout arithmetic, exhaustively over sizes, world sizes 1..8 and alignments: every parameter
// has its own range, buckets split evenly, shards tile the buckets, empty shards are allowed.
#include <gtest/gtest.h>

#include <numeric>

#include "shardopt/detail/partition.hpp"

namespace shardopt::detail {
namespace {

TEST(FlatLayout, InvariantsHoldForManyShapes) {
  const std::vector<std::vector<int64_t>> models{{1}, {3, 1, 7}, {100, 1, 1, 64, 5}, {1000}, {2, 2}};
  for (const auto& numels : models) {
    for (int world = 1; world <= 8; ++world) {
      for (int64_t align : {1, 4, 16}) {
        for (int64_t bucket : {1, 8, 100, 1 << 20}) {
          std::vector<int> groups(numels.size(), 0);
          if (numels.size() > 2) groups.back() = 1;
          const FlatLayout l = make_layout(numels, groups, world, align, bucket);
          int64_t total = 0, padded = 0, shard = 0;
          for (const auto& b : l.buckets) {
            EXPECT_EQ(b.padded % (world * align), 0);
            EXPECT_EQ(b.shard * world, b.padded);
            EXPECT_GE(b.padded, b.numel);
            EXPECT_EQ(b.flat_offset, padded);
            EXPECT_EQ(b.shard_offset, shard);
            padded += b.padded;
            shard += b.shard;
            int64_t at = 0;
            for (int i : b.params) {
              EXPECT_EQ(l.slots[i].offset, at);  // packed, in order, no overlap
              EXPECT_EQ(groups[i], b.group);     // a bucket never spans groups
              at += l.slots[i].numel;
            }
            EXPECT_EQ(at, b.numel);
          }
          for (size_t i = 0; i < numels.size(); ++i) total += l.slots[i].numel;
          EXPECT_EQ(total, std::accumulate(numels.begin(), numels.end(), int64_t{0}));
          EXPECT_EQ(l.numel, total);
          EXPECT_EQ(l.padded_numel, padded);
          EXPECT_EQ(l.shard_numel * world, padded);
        }
      }
    }
  }
}

TEST(FlatLayout, LargeParameterGetsItsOwnBucketAndSmallOnesShare) {
  const FlatLayout l = make_layout({10, 500, 20, 30}, {0, 0, 0, 0}, 2, 1, 100);
  ASSERT_EQ(l.buckets.size(), 3u);
  EXPECT_EQ(l.buckets[0].params, std::vector<int>{0});
  EXPECT_EQ(l.buckets[1].params, std::vector<int>{1});
  EXPECT_EQ(l.buckets[2].params, (std::vector<int>{2, 3}));
}

TEST(FlatLayout, MoreRanksThanElementsGivesPaddingOnlyShards) {
  const FlatLayout l = make_layout({1}, {0}, 8, 1, 100);
  ASSERT_EQ(l.buckets.size(), 1u);
  EXPECT_EQ(l.buckets[0].padded, 8);
  EXPECT_EQ(l.buckets[0].shard, 1);
  EXPECT_TRUE(intersect(l.buckets[0].owned(5), {0, 1}).empty());
  EXPECT_EQ(intersect(l.buckets[0].owned(0), {0, 1}).size(), 1);
}

}  // namespace
}  // namespace shardopt::detail
