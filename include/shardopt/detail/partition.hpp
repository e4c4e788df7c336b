// Pure index maths of the flat layout (torch-free, header-only): parameters packed into buckets,
// each bucket padded so that it splits evenly into world-size shards; rank r owns
// [r*S, (r+1)*S) of every bucket. A bucket is the unit of one reduce-scatter/all-gather.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace shardopt::detail {

// Where one parameter lives: bucket and element offset inside it.
struct ParamSlot {
  int bucket = 0;
  int64_t offset = 0;
  int64_t numel = 0;
};

// A half-open element range [begin, end).
struct ShardRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool empty() const { return end <= begin; }
};

inline ShardRange intersect(ShardRange a, ShardRange b) {
  return {std::max(a.begin, b.begin), std::max(std::max(a.begin, b.begin), std::min(a.end, b.end))};
}

struct BucketLayout {
  int group = 0;
  int unit = 0;              // stage 3: the unit whose parameters it holds
  int64_t flat_offset = 0;   // start in the full flat buffer
  int64_t numel = 0;         // parameters' elements
  int64_t padded = 0;        // numel rounded up to a multiple of world * align
  int64_t shard = 0;         // padded / world
  int64_t shard_offset = 0;  // start of this bucket's shard inside a rank's shard buffers
  std::vector<int> params;   // indices into FlatLayout::slots
  // This rank's slice, in bucket coordinates.
  ShardRange owned(int rank) const { return {rank * shard, (rank + 1) * shard}; }
};

struct FlatLayout {
  std::vector<ParamSlot> slots;
  std::vector<BucketLayout> buckets;
  int64_t numel = 0;         // sum of parameters
  int64_t padded_numel = 0;  // full flat buffer length
  int64_t shard_numel = 0;   // one rank's shard buffers length (padded_numel / world)
};

inline int64_t round_up(int64_t x, int64_t multiple) {
  return multiple <= 1 ? x : (x + multiple - 1) / multiple * multiple;
}

// Packs parameters, in the given order, greedily into buckets of at most `bucket_numel`
// elements (a larger parameter gets a bucket of its own); a bucket never spans two groups, nor
// two units when `units` is given. `numels[i]`, `groups[i]` (and `units[i]`) describe parameter
// i. Empty shards are allowed (world > numel).
inline FlatLayout make_layout(const std::vector<int64_t>& numels, const std::vector<int>& groups,
                              int world, int64_t align_numel, int64_t bucket_numel,
                              const std::vector<int>& units = {}) {
  FlatLayout layout;
  layout.slots.resize(numels.size());
  const int64_t quantum = static_cast<int64_t>(world) * std::max<int64_t>(1, align_numel);
  auto close = [&](BucketLayout& b) {
    b.padded = round_up(std::max<int64_t>(b.numel, 1), quantum);
    b.shard = b.padded / world;
    b.flat_offset = layout.padded_numel;
    b.shard_offset = layout.shard_numel;
    layout.padded_numel += b.padded;
    layout.shard_numel += b.shard;
    layout.buckets.push_back(b);
  };
  BucketLayout open;
  bool has_open = false;
  for (size_t i = 0; i < numels.size(); ++i) {
    const int unit = units.empty() ? 0 : units[i];
    const bool fits = has_open && open.group == groups[i] && open.unit == unit &&
                      open.numel + numels[i] <= bucket_numel;
    if (has_open && !fits) {
      close(open);
      has_open = false;
    }
    if (!has_open) {
      open = BucketLayout{};
      open.group = groups[i];
      open.unit = unit;
      has_open = true;
    }
    layout.slots[i] = ParamSlot{static_cast<int>(layout.buckets.size()), open.numel, numels[i]};
    open.params.push_back(static_cast<int>(i));
    open.numel += numels[i];
    layout.numel += numels[i];
  }
  if (has_open) close(open);
  return layout;
}

}  // namespace shardopt::detail
