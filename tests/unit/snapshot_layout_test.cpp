// The saving layout a snapshot record carries (Note [Snapshots at another world size] in
// shardopt/snapshot.hpp): read back, it gives the same saved pieces as the layout that wrote it at
// every world size, buckets and alignment; a malformed one is a named Error{Checkpoint}.
#include <gtest/gtest.h>

#include <vector>

#include "checkpoint/snapshot_record.hpp"
#include "shardopt/detail/shard_plan.hpp"
#include "support/expect_error.hpp"

namespace shardopt {
namespace {

using detail::json;

// An empty parameter, parameters split across buckets, two groups.
detail::FlatLayout layout_at(int world, int64_t bucket_numel) {
  return detail::make_layout({5, 0, 17, 3, 40}, {0, 0, 0, 1, 1}, world, 2, bucket_numel);
}

TEST(SnapshotLayout, RoundTripGivesTheSavedPieces) {
  for (int world = 1; world <= 5; ++world) {
    for (int64_t bucket : {4, 12, 1000}) {
      const detail::FlatLayout l = layout_at(world, bucket);
      const json j = json::parse(detail::snapshot_layout(l, world - 1).dump());
      EXPECT_EQ(j.at("shard_rank"), world - 1);
      const detail::FlatLayout back = detail::layout_from_snapshot(j, 5, "test");
      EXPECT_EQ(back.shard_numel, l.shard_numel);
      for (int i = 0; i < 5; ++i) {
        const auto want = detail::saved_pieces(l, i, world);
        const auto got = detail::saved_pieces(back, i, world);
        ASSERT_EQ(got.size(), want.size()) << "world " << world << " bucket " << bucket;
        for (size_t k = 0; k < got.size(); ++k) {
          EXPECT_EQ(got[k].rank, want[k].rank);
          EXPECT_EQ(got[k].shard_begin, want[k].shard_begin);
          EXPECT_EQ(got[k].param_begin, want[k].param_begin);
          EXPECT_EQ(got[k].numel, want[k].numel);
        }
        EXPECT_TRUE(detail::covers(got, l.slots[static_cast<size_t>(i)].numel));
      }
    }
  }
}

TEST(SnapshotLayout, MalformedLayoutsAreNamed) {
  const json good = detail::snapshot_layout(layout_at(3, 12), 0);
  auto edited = [&](auto edit) {
    json j = good;
    edit(j);
    return j;
  };
  const std::vector<json> bad = {
      edited([](json& j) { j["pieces"][0][0] = 7; }),                      // no such parameter
      edited([](json& j) { j["pieces"][0][1] = 99; }),                     // no such bucket
      edited([](json& j) { j["pieces"][0][4] = -1; }),                     // negative count
      edited([](json& j) { std::swap(j["pieces"][0], j["pieces"][2]); }),  // not in order
      edited([](json& j) { j["buckets"][0][1] = 1000; }),                  // outside the shard
      edited([](json& j) { j.erase("pieces"); }),
      edited([](json& j) { j["buckets"][0] = "x"; })};
  for (const json& j : bad) {
    test::expect_error([&] { detail::layout_from_snapshot(j, 5, "rank0.slot1"); },
                       ErrorKind::Checkpoint, {"snapshot", "rank0.slot1"});
  }
}

}  // namespace
}  // namespace shardopt
