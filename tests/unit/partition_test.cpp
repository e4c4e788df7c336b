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
            for (int k : b.pieces) {
              const ParamPiece& p = l.pieces[k];
              EXPECT_EQ(p.offset, at);              // packed, in order, no overlap
              EXPECT_EQ(groups[p.param], b.group);  // a bucket never spans groups
              at += p.numel;
            }
            EXPECT_EQ(at, b.numel);
            // Buffers are bounded by the bucket size (rounded to the quantum), not by parameters.
            const int64_t quantum = world * align;
            EXPECT_LE(b.padded, std::max<int64_t>(quantum, bucket / quantum * quantum));
          }
          for (size_t i = 0; i < numels.size(); ++i) {
            const int index = static_cast<int>(i);
            total += l.slots[i].numel;
            // Pieces tile the parameter, and it is contiguous in the full flat buffer.
            int64_t next = 0;
            for (const ParamPiece* p = l.pieces_begin(index); p != l.pieces_end(index); ++p) {
              EXPECT_EQ(p->param, index);
              EXPECT_EQ(p->param_offset, next);
              EXPECT_EQ(l.buckets[p->bucket].flat_offset + p->offset,
                        l.flat_offset(index) + p->param_offset);
              next += p->numel;
            }
            EXPECT_EQ(next, numels[i]);
          }
          EXPECT_EQ(total, std::accumulate(numels.begin(), numels.end(), int64_t{0}));
          EXPECT_EQ(l.numel, total);
          EXPECT_EQ(l.padded_numel, padded);
          EXPECT_EQ(l.shard_numel * world, padded);
        }
      }
    }
  }
}

TEST(FlatLayout, LargeParameterSpansBucketsSplitAtTheQuantum) {
  // world 2, align 1, buckets of 100: 10 + 90 of the 500, then 100 x 4, then 10 + 20 + 30.
  const FlatLayout l = make_layout({10, 500, 20, 30}, {0, 0, 0, 0}, 2, 1, 100);
  ASSERT_EQ(l.buckets.size(), 6u);
  EXPECT_EQ(l.buckets[0].params, (std::vector<int>{0, 1}));
  for (int b = 1; b < 5; ++b) EXPECT_EQ(l.buckets[b].params, std::vector<int>{1});
  EXPECT_EQ(l.buckets[5].params, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(l.slots[1].piece_count, 6);
  EXPECT_EQ(l.pieces_begin(1)->numel, 90);
  EXPECT_EQ((l.pieces_end(1) - 1)->numel, 10);
  for (int b = 0; b < 5; ++b) EXPECT_EQ(l.buckets[b].padded, 100);  // split buckets are full
  // Splits respect the quantum (world 4 x align 8 = 32): 64-element buckets, no inner padding.
  const FlatLayout q = make_layout({5, 200}, {0, 0}, 4, 8, 70);
  for (const auto& b : q.buckets) EXPECT_LE(b.padded, 64);
  EXPECT_EQ(q.flat_offset(1), 5);
  // A unit change closes the bucket (padded); the next unit starts a fresh one.
  const FlatLayout u = make_layout({5, 200}, {0, 0}, 2, 1, 64, {0, 1});
  EXPECT_EQ(u.slots[1].bucket, 1);
  EXPECT_EQ(u.slots[1].offset, 0);
  EXPECT_EQ(u.slots[1].piece_count, 4);
}

// 8-bit AdamW's layout (param_align 256, align 256): every parameter starts on a block of its
// bucket, and every piece of a split parameter starts on a block of the parameter, so shard and
// bucket boundaries never cut a block (Note [Blockwise 8-bit state]).
TEST(FlatLayout, ParamAlignStartsParametersOnBlocks) {
  const std::vector<int64_t> numels = {10, 5000, 300, 256, 4097, 1, 700};
  for (int world : {1, 2, 3, 4}) {
    const FlatLayout l = make_layout(numels, std::vector<int>(numels.size(), 0), world, 256,
                                     3000, {}, 256);
    for (int i = 0; i < static_cast<int>(numels.size()); ++i) {
      EXPECT_EQ(l.slots[i].offset % 256, 0) << "world " << world << " param " << i;
      for (const ParamPiece* p = l.pieces_begin(i); p != l.pieces_end(i); ++p) {
        EXPECT_EQ(p->offset % 256, 0);
        EXPECT_EQ(p->param_offset % 256, 0);
      }
    }
    for (const auto& b : l.buckets) EXPECT_EQ(b.shard % 256, 0);
  }
  // Without it, parameters pack back to back as before.
  EXPECT_EQ(make_layout({10, 20}, {0, 0}, 1, 1, 100).slots[1].offset, 10);
  EXPECT_EQ(make_layout({10, 20}, {0, 0}, 1, 1, 100, {}, 16).slots[1].offset, 16);
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
