// 8-bit AdamW over this rank's segments (rules.hpp: AdamW8bit): its state buffers in the flat
// state and the per-piece calls of the fused kernel (src/kernels/adam8bit.hpp).
//
// Note [Blockwise 8-bit state]
// The moments of a parameter are quantised in blocks of 256 of its elements (bitsandbytes'
// blockwise 8-bit Adam), each block with its own absolute maximum. For the result not to depend on
// the number of ranks a block must never straddle a shard: the flat layout starts every parameter
// at a multiple of 256 elements of its bucket (make_layout's param_align) and shards are multiples
// of 256 (the layout's alignment is at least 256 elements), so shard and bucket boundaries fall on
// block boundaries of every parameter, and a rank holds whole blocks. The state buffers, in the
// engine's order:
//   0, 1  state1, state2: uint8 codes of m and v, update coordinates (one byte per element);
//   2, 3  absmax1, absmax2: fp32, one per 256 elements of update coordinates (block b of the
//         buffer covers elements [256b, 256b + 256), the gaps between parameters included);
//   4, 5  state1_fp32, state2_fp32: fp32 m and v of the parameters under min_8bit_size
//         (bitsandbytes keeps those in fp32), packed in update-coordinate order.
// So a rank holds 2 + 8/256 bytes per element plus 8 per element of a small parameter. Gaps and
// padding have zero gradients: their codes stay zero, and a block's maximum ignores them.
// Checkpoints store these buffers as they are, quantised, and reshard them exactly across N and
// stages (Note [Quantised state in checkpoints], shardopt/detail/state_sections.hpp).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "engine/flat_state.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/rules.hpp"

namespace shardopt::detail {

class Adam8bitUpdate {
 public:
  using RuleOf = std::function<const Rule&(int group)>;
  // Allocates the state buffers in `flat` (Note [Blockwise 8-bit state]); the master weights must
  // be fp32 on the CPU (Unsupported otherwise). `rule`: the optimizer's, whose min_8bit_size every
  // group shares (groups set only lr and weight decay); `rule_of` is read from the first step on.
  Adam8bitUpdate(FlatState& flat, const AdamW8bit& rule, RuleOf rule_of);
  void update(int64_t step);

  // One parameter piece of a segment: 8-bit blocks, or fp32 moments at `compact`.
  struct Piece {
    int segment = 0;
    int64_t begin = 0;   // relative to the segment
    int64_t length = 0;
    bool small = false;
    int64_t compact = 0;  // small: first element in buffers 4 and 5
  };
  const std::vector<Piece>& pieces() const { return pieces_; }

  // This rank's owned slice of `bucket` in state buffer `k` (Note [Quantised state in
  // checkpoints]): codes S_b bytes, maxima S_b / 256 entries, fp32 moments the small parameters'
  // owned elements (contiguous in buffers 4 and 5).
  at::Tensor owned_state_slice(int k, int bucket);
  // Stage 0 after a load wrote only the owned slices: every rank's slices to every rank.
  void replicate_owned(Communicator& comm, Duration timeout);

 private:
  FlatState& flat_;
  RuleOf rule_of_;
  std::vector<Piece> pieces_;
};

}  // namespace shardopt::detail
