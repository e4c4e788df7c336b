// Pure index maths of checkpoint resharding (torch-free, header-only). A checkpoint stores, per
// parameter, the pieces of it that each saving rank wrote ("saved pieces"); loading on another
// world size or stage maps this rank's owned elements back onto those pieces ("copy ops").
//
// Shard coordinates: a rank's owned slices [r*S, (r+1)*S) of every bucket, concatenated in bucket
// order; bucket b starts at its shard_offset. Every section of a shard file (parameters, each
// optimizer state buffer) is laid out in these coordinates.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "shardopt/detail/partition.hpp"

namespace shardopt::detail {

// Elements [param_begin, param_begin + numel) of one parameter, stored by `rank` at element
// `shard_begin` (shard coordinates) of each section of its file.
struct SavedPiece {
  int rank = 0;
  int64_t shard_begin = 0;
  int64_t param_begin = 0;
  int64_t numel = 0;
};

// The pieces of parameter `index` under `layout` with `world` ranks, in parameter order (a
// parameter spanning buckets has a layout piece in each, and each of those may be split by ranks).
inline std::vector<SavedPiece> saved_pieces(const FlatLayout& layout, int index, int world) {
  std::vector<SavedPiece> out;
  for (const ParamPiece* lp = layout.pieces_begin(index); lp != layout.pieces_end(index); ++lp) {
    const BucketLayout& bl = layout.buckets[lp->bucket];
    const ShardRange range{lp->offset, lp->offset + lp->numel};
    for (int r = 0; r < world; ++r) {
      const ShardRange piece = intersect(range, bl.owned(r));
      if (piece.empty()) continue;
      out.push_back({r, bl.shard_offset + piece.begin - r * bl.shard,
                     lp->param_offset + piece.begin - lp->offset, piece.size()});
    }
  }
  return out;
}

// Copy `numel` elements from `src_rank`'s file at `src` to this rank's shard at `dst` (both in
// shard coordinates).
struct CopyOp {
  int src_rank = 0;
  int64_t src = 0;
  int64_t dst = 0;
  int64_t numel = 0;
};

// What `rank` must read to fill its owned elements of parameter `index` under `layout`, given
// where a checkpoint saved that parameter. Elements the saved pieces do not cover produce no op
// (callers check coverage with covers()).
inline std::vector<CopyOp> plan_copies(const FlatLayout& layout, int rank, int index,
                                       const std::vector<SavedPiece>& saved) {
  std::vector<CopyOp> out;
  for (const ParamPiece* lp = layout.pieces_begin(index); lp != layout.pieces_end(index); ++lp) {
    const BucketLayout& bl = layout.buckets[lp->bucket];
    const ShardRange mine = intersect({lp->offset, lp->offset + lp->numel}, bl.owned(rank));
    if (mine.empty()) continue;
    // Parameter-element range this rank owns in this bucket.
    const int64_t to_param = lp->param_offset - lp->offset;
    const ShardRange need{mine.begin + to_param, mine.end + to_param};
    for (const SavedPiece& p : saved) {
      const ShardRange got = intersect(need, {p.param_begin, p.param_begin + p.numel});
      if (got.empty()) continue;
      out.push_back({p.rank, p.shard_begin + (got.begin - p.param_begin),
                     bl.shard_offset + (got.begin - to_param - rank * bl.shard), got.size()});
    }
  }
  return out;
}

// True when the pieces cover [0, numel) of a parameter exactly once.
inline bool covers(std::vector<SavedPiece> pieces, int64_t numel) {
  std::sort(pieces.begin(), pieces.end(),
            [](const SavedPiece& a, const SavedPiece& b) { return a.param_begin < b.param_begin; });
  int64_t next = 0;
  for (const SavedPiece& p : pieces) {
    if (p.param_begin != next || p.numel <= 0 || p.numel > numel - next) return false;
    next += p.numel;
  }
  return next == numel;
}

}  // namespace shardopt::detail
