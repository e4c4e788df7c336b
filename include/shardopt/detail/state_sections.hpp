// How each optimizer state section of a checkpoint's shard file is indexed against the shard's
// elements, and the entries an element copy of a resharding load moves in each (torch-free,
// header-only). Elementwise rules keep one entry per element; 8-bit AdamW does not.
//
// Note [Quantised state in checkpoints]
// A shard file holds, per section, the concatenation of a rank's owned slices of every bucket
// (Note [Flat layout], src/engine/flat_state.hpp). 8-bit AdamW's six state buffers (Note
// [Blockwise 8-bit state], src/engine/adam8bit_update.hpp) are stored as they are, quantised,
// in three kinds of section:
//   state1, state2           uint8, one entry per element of the shard (the codes);
//   absmax1, absmax2         fp32, one entry per 256 elements of the shard: entry e/256 is the
//                            maximum of the block holding element e ("positional, block 256");
//   state1_fp32, state2_fp32 fp32, one entry per element of a parameter under min_8bit_size, in
//                            shard order, the other parameters' elements skipped ("packed").
// Every parameter starts at a multiple of 256 elements of its bucket and every shard and bucket
// boundary is a multiple of 256 (the layout of this rule), so a block belongs to one parameter,
// its index in the parameter (param element / 256) is the same in every layout, and a load at
// any N, stage or bucket size maps element copies to entry copies exactly: a run of elements
// [src, src + n) of a parameter maps to blocks [src/256, ceil((src + n)/256)) and to packed
// entries by the saving rank's runs of small parameters, which the manifest's piece table gives
// (each piece of a parameter under the threshold is one run). Nothing is requantised, so a
// resumed run is bitwise the uninterrupted one. The loader checks what this relies on, by name:
// every piece of every parameter on a block boundary in both layouts, the same min_8bit_size,
// each section's dtype and entry count. On disk: 4 bytes per element of parameters, 2 of codes,
// 8/256 of maxima, and 8 more per element of a small parameter (AdamW: 4 + 8).
// Paths that hand the state out per element (torch state dicts, full states, consolidation) have
// no place for blocks and refuse adamw8bit by name.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <variant>
#include <vector>

#include "shardopt/detail/shard_plan.hpp"
#include "shardopt/rules.hpp"

namespace shardopt::detail {

// How the entries of one state section relate to a shard's elements.
struct SectionIndex {
  int64_t block = 1;        // positional: entry e / block holds shard element e
  bool packed = false;      // one entry per element of a small parameter, in shard order
  double small_below = 0;   // packed: "small" is fewer elements than this
  bool bytes = false;       // uint8 entries (else the master dtype)
  bool small(int64_t param_numel) const {
    return static_cast<double>(param_numel) < small_below;
  }
  bool elementwise() const { return block == 1 && !packed; }
};

// The sections of `rule`'s `count` state buffers, in the engine's order.
inline std::vector<SectionIndex> section_indices(const Rule& rule, int count) {
  std::vector<SectionIndex> out(static_cast<size_t>(count));
  if (const auto* r = std::get_if<AdamW8bit>(&rule)) {
    const double below = r->min_8bit_size();
    out = {{1, false, 0, true},     {1, false, 0, true},     {AdamW8bit::kBlock, false, 0, false},
           {AdamW8bit::kBlock, false, 0, false}, {1, true, below, false}, {1, true, below, false}};
    out.resize(static_cast<size_t>(count));
  }
  return out;
}

// True when every section of `rule` has one entry per element.
inline bool elementwise_state(const Rule& rule) { return !std::holds_alternative<AdamW8bit>(rule); }

// A piece of a parameter a rank holds (SavedPiece) with the parameter's element count.
struct HeldPiece {
  SavedPiece piece;
  int64_t param_numel = 0;
};

// One state section of one rank's shard: where each shard element's entry is.
class SectionMap {
 public:
  SectionMap() = default;
  // `pieces`: every piece the rank holds; `shard_numel`: its shard's length.
  SectionMap(const SectionIndex& index, int64_t shard_numel, std::vector<HeldPiece> pieces)
      : index_(index), shard_numel_(shard_numel) {
    if (!index_.packed) return;
    std::sort(pieces.begin(), pieces.end(), [](const HeldPiece& x, const HeldPiece& y) {
      return x.piece.shard_begin < y.piece.shard_begin;
    });
    for (const HeldPiece& h : pieces) {
      if (!index_.small(h.param_numel) || h.piece.numel <= 0) continue;
      runs_.push_back({h.piece.shard_begin, h.piece.numel, total_});
      total_ += h.piece.numel;
    }
  }
  const SectionIndex& index() const { return index_; }
  // Entries in the section.
  int64_t size() const { return index_.packed ? total_ : shard_numel_ / index_.block; }
  // Entries before shard element `e` (a bucket's first element: where its slice starts).
  int64_t before(int64_t e) const {
    if (!index_.packed) return e / index_.block;
    // The last run starting before e (runs are sorted and disjoint).
    auto it = std::lower_bound(runs_.begin(), runs_.end(), e,
                               [](const Run& r, int64_t x) { return r.begin < x; });
    if (it == runs_.begin()) return 0;
    --it;
    return it->entry + std::min(it->numel, e - it->begin);
  }
  // The entries of elements [e, e + numel) of one parameter piece (a parameter of `param_numel`
  // elements): first entry and count (count 0: none in this section).
  std::pair<int64_t, int64_t> entries(int64_t e, int64_t numel, int64_t param_numel) const {
    if (numel <= 0) return {0, 0};
    if (index_.packed) {
      if (!index_.small(param_numel)) return {0, 0};
      return {before(e), numel};
    }
    const int64_t b = index_.block;
    return {e / b, (e + numel + b - 1) / b - e / b};
  }

 private:
  struct Run {
    int64_t begin = 0, numel = 0, entry = 0;
  };
  SectionIndex index_;
  int64_t shard_numel_ = 0;
  std::vector<Run> runs_;  // packed: the small parameters' pieces, in shard order
  int64_t total_ = 0;
};

// The pieces `rank` holds under `layout` with `world` ranks.
inline std::vector<HeldPiece> held_pieces(const FlatLayout& layout, int rank, int world) {
  std::vector<HeldPiece> out;
  for (int i = 0; i < static_cast<int>(layout.slots.size()); ++i) {
    for (const SavedPiece& p : saved_pieces(layout, i, world)) {
      if (p.rank == rank) out.push_back({p, layout.slots[i].numel});
    }
  }
  return out;
}

// True when a positional section of `block` maps the piece exactly: it starts on a block
// boundary of the shard and of its parameter.
inline bool block_aligned(const SavedPiece& p, int64_t block) {
  return p.shard_begin % block == 0 && p.param_begin % block == 0;
}

}  // namespace shardopt::detail
