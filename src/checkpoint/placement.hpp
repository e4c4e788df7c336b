// Where one rank's copy of a parameter sits in the unsplit tensor, and which elements of the saved
// copies (one per saved tensor rank) feed a range of another layout's copy. Pure index maths,
// torch-free and header-only; internal to src/checkpoint/.
//
// Note [Placement in the manifest]
// Every parameter a checkpoint folder lists records its local shape, the unsplit ("global")
// shape, and, when tensor parallelism splits it, the split: dim, full size, padded size, and the
// saving copy's tensor rank of tensor size (Note [Split records] in shardopt/tensor_parallel.hpp).
// Tensor rank k of t holds rows [k P/t, (k+1) P/t) of the padded tensor along dim (P the padded
// size; rows at the full size and beyond are padding), so the global offset of every saved element
// follows from the record, and the folder's piece table (its data-parallel ranks' files) says
// where each local element lies on disk. A load into any other layout maps each range of its own
// local elements (a run of the flat layout it owns) to runs of one saved copy's local elements by
// the rows they cover (place() below), then to byte ranges of the files through the piece table,
// and reads only those (Note [Block checksums] in files.hpp). Padding rows are copied where both
// layouts have them and left as they are otherwise; a layout whose padded size is larger than the
// save's keeps its own values in the extra rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace shardopt::detail {

// One copy of a parameter: its local shape and, when split, along which dim and where.
struct TensorPlacement {
  std::vector<int64_t> shape;  // local
  int64_t dim = -1;            // split dim, -1: whole
  int64_t full = 0;            // along dim: unsplit size, without padding
  int64_t padded = 0;          // along dim: t x the local size
  int rank = 0, ranks = 1;     // tensor rank of tensor size
  bool split() const { return dim >= 0; }
  // The unsplit shape: the local one with the split dim at its full size.
  std::vector<int64_t> global_shape() const {
    std::vector<int64_t> g = shape;
    if (split()) g[dim] = full;
    return g;
  }
};

// Copy `numel` local elements of saved tensor rank `src_rank`'s copy at `src` to the target's
// local element `dst`.
struct PlacedRun {
  int src_rank = 0;
  int64_t src = 0, dst = 0, numel = 0;
};

// The runs that fill local elements [begin, end) of `to` from the saved copies of `from` (one per
// saved tensor rank, all shaped like `from.shape`; from.rank is ignored). The two must have the
// same global shape and, when both are split, the same split dim (callers check). Elements of `to`
// beyond `from`'s padded rows get no run. When neither is split every element comes from copy
// `whole_rank` (a replicated parameter is saved by every tensor rank: any copy serves).
inline std::vector<PlacedRun> place(const TensorPlacement& to, const TensorPlacement& from,
                                    int64_t begin, int64_t end, int whole_rank = 0) {
  std::vector<PlacedRun> out;
  if (begin >= end) return out;
  const int64_t dim = to.split() ? to.dim : from.dim;
  if (dim < 0 || to.shape.empty()) {
    out.push_back({whole_rank, begin, begin, end - begin});
    return out;
  }
  int64_t inner = 1;
  for (size_t k = static_cast<size_t>(dim) + 1; k < to.shape.size(); ++k) inner *= to.shape[k];
  const int64_t rows_to = to.shape[dim], rows_from = from.shape[dim];
  const int64_t first_to = to.split() ? to.rank * rows_to : 0;  // global row of local row 0
  // Saved copies hold global rows [0, from_rows_total): t of them, rows_from each.
  const int64_t rows_total = from.split() ? from.padded : rows_from;
  const int64_t chunk = std::max<int64_t>(inner, 1);
  for (int64_t i = begin; i < end;) {
    const int64_t row = i / chunk, within = i % chunk;
    const int64_t outer = row / rows_to, local = row % rows_to, global = first_to + local;
    // Rows this run may span: to the end of this outer slice and of the saved copy holding it.
    const int64_t rows_left_to = rows_to - local;
    if (global >= rows_total) {  // a row the save does not have (padding of a larger layout)
      i = std::min(end, (row + rows_left_to) * chunk);
      continue;
    }
    const int src_rank = static_cast<int>(global / rows_from);
    const int64_t src_local = global % rows_from;
    const int64_t rows = std::min({rows_left_to, rows_from - src_local, rows_total - global});
    const int64_t stop = std::min(end, (row + rows) * chunk);
    out.push_back({src_rank, (outer * rows_from + src_local) * chunk + within, i, stop - i});
    i = stop;
  }
  return out;
}

}  // namespace shardopt::detail
