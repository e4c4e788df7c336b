// Pure index maths of the flat layout (torch-free, header-only): parameters packed into buckets,
// each bucket padded so that it splits evenly into world-size shards; rank r owns
// [r*S, (r+1)*S) of every bucket. A bucket is the unit of one reduce-scatter/all-gather.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace shardopt::detail {

// Where one parameter lives: its first bucket and element offset there. A parameter may span
// several consecutive buckets (a split point falls where a bucket is exactly full, a multiple of
// world * align, so no padding falls inside it): its elements stay contiguous in the full flat
// buffer, starting at FlatLayout::flat_offset(i). Its pieces, one per bucket, are
// FlatLayout::pieces[first_piece, first_piece + piece_count).
struct ParamSlot {
  int bucket = 0;
  int64_t offset = 0;
  int64_t numel = 0;
  int first_piece = 0;
  int piece_count = 1;
};

// The part of parameter `param` inside bucket `bucket`: elements [param_offset, param_offset +
// numel) of the parameter at [offset, offset + numel) of the bucket.
struct ParamPiece {
  int param = 0;
  int bucket = 0;
  int64_t offset = 0;
  int64_t param_offset = 0;
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
  int part = 0;              // stage 3: the part whose parameters it holds
  int64_t flat_offset = 0;   // start in the full flat buffer
  int64_t numel = 0;         // parameters' elements
  int64_t padded = 0;        // numel rounded up to a multiple of world * align
  int64_t shard = 0;         // padded / world
  int64_t shard_offset = 0;  // start of this bucket's shard inside a rank's shard buffers
  std::vector<int> params;   // parameters with a piece here (indices into FlatLayout::slots)
  std::vector<int> pieces;   // those pieces (indices into FlatLayout::pieces), in order
  // This rank's slice, in bucket coordinates.
  ShardRange owned(int rank) const { return {rank * shard, (rank + 1) * shard}; }
};

struct FlatLayout {
  std::vector<ParamSlot> slots;
  std::vector<ParamPiece> pieces;  // grouped by parameter, in parameter order
  std::vector<BucketLayout> buckets;
  int64_t numel = 0;         // sum of parameters
  int64_t padded_numel = 0;  // full flat buffer length
  int64_t shard_numel = 0;   // one rank's shard buffers length (padded_numel / world)

  // Parameter i's first element in the full flat buffer (its elements are contiguous there).
  int64_t flat_offset(int i) const {
    return buckets[slots[i].bucket].flat_offset + slots[i].offset;
  }
  // Parameter i's pieces, one per bucket it spans.
  const ParamPiece* pieces_begin(int i) const { return pieces.data() + slots[i].first_piece; }
  const ParamPiece* pieces_end(int i) const { return pieces_begin(i) + slots[i].piece_count; }
};

inline int64_t round_up(int64_t x, int64_t multiple) {
  return multiple <= 1 ? x : (x + multiple - 1) / multiple * multiple;
}

// Packs parameters, in the given order, into buckets of `bucket_numel` elements rounded down to
// a multiple of world * align (at least one such multiple): a parameter that does not fit in the
// open bucket fills it and continues in the next ones, so no bucket is sized by the largest
// parameter. A bucket never spans two groups, nor two stage-3 parts when `parts` is given (it is
// closed, padded to a multiple of world * align, before the next group or part). `numels[i]`,
// `groups[i]` (and `parts[i]`) describe parameter i. Empty shards are allowed (world > numel).
// `param_align` (dividing world * align_numel): every parameter starts at a multiple of it in its
// bucket (8-bit AdamW: Note [Blockwise 8-bit state] in src/engine/adam8bit_update.hpp).
inline FlatLayout make_layout(const std::vector<int64_t>& numels, const std::vector<int>& groups,
                              int world, int64_t align_numel, int64_t bucket_numel,
                              const std::vector<int>& parts = {}, int64_t param_align = 1) {
  FlatLayout layout;
  layout.slots.resize(numels.size());
  const int64_t quantum = static_cast<int64_t>(world) * std::max<int64_t>(1, align_numel);
  // A split bucket ends exactly full, so its capacity is a multiple of the quantum.
  const int64_t capacity = std::max(quantum, bucket_numel / quantum * quantum);
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
  auto start = [&](int group, int part) {
    open = BucketLayout{};
    open.group = group;
    open.part = part;
    has_open = true;
  };
  for (size_t i = 0; i < numels.size(); ++i) {
    const int part = parts.empty() ? 0 : parts[i];
    if (has_open && (open.group != groups[i] || open.part != part)) {
      close(open);
      has_open = false;
    }
    // A parameter starts at a multiple of param_align of its bucket (the gap is padding); the
    // capacity is a multiple of it, so rounding up never overflows the bucket.
    if (has_open) open.numel = round_up(open.numel, param_align);
    ParamSlot& slot = layout.slots[i];
    slot.first_piece = static_cast<int>(layout.pieces.size());
    slot.piece_count = 0;
    slot.numel = numels[i];
    int64_t done = 0;
    do {
      if (has_open && open.numel == capacity && done < numels[i]) {
        close(open);
        has_open = false;
      }
      if (!has_open) start(groups[i], part);
      const int64_t take = std::min(numels[i] - done, capacity - open.numel);
      ParamPiece piece{static_cast<int>(i), static_cast<int>(layout.buckets.size()), open.numel,
                       done, take};
      if (slot.piece_count == 0) {
        slot.bucket = piece.bucket;
        slot.offset = piece.offset;
      }
      ++slot.piece_count;
      open.params.push_back(static_cast<int>(i));
      open.pieces.push_back(static_cast<int>(layout.pieces.size()));
      layout.pieces.push_back(piece);
      open.numel += take;
      done += take;
    } while (done < numels[i]);
    layout.numel += numels[i];
  }
  if (has_open) close(open);
  return layout;
}

// Runs of consecutive buckets joined by split parameters ("chunks"): a bucket starts a new run
// unless a parameter continues into it from the one before. Each run is contiguous in the full
// flat buffer and holds whole parameters, so it can be its own allocation while every parameter
// stays one view (stages 0-2 build their parameter storage chunk by chunk).
struct BucketRun {
  int first_bucket = 0;
  int bucket_count = 0;
  int64_t flat_offset = 0;  // in the full flat buffer
  int64_t numel = 0;        // padded elements of its buckets
};

inline std::vector<BucketRun> bucket_runs(const FlatLayout& layout) {
  std::vector<BucketRun> runs;
  for (int b = 0; b < static_cast<int>(layout.buckets.size()); ++b) {
    const auto& bl = layout.buckets[b];
    const bool continues = !runs.empty() && !bl.pieces.empty() &&
                           layout.pieces[bl.pieces.front()].param_offset > 0;
    if (!continues) runs.push_back({b, 0, bl.flat_offset, 0});
    ++runs.back().bucket_count;
    runs.back().numel += bl.padded;
  }
  return runs;
}

}  // namespace shardopt::detail
