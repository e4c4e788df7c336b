// Adafactor over flat shards (torch.optim.Adafactor, torch >= 2.5): where its state lives in the
// flat state buffer, the all-reduced per-tensor statistics, and the conversion to and from torch's
// per-parameter state (row_var, col_var, variance) for state dicts.
//
// Note [Factored state in flat shards]
// torch keeps, per tensor of two or more dimensions (factored over its last two, B x m x n), a row
// factor row_var (B·m) and a column factor col_var (B·n); per vector or scalar a full variance.
// shardopt keeps them in one flat state buffer ("factored_variance", in update coordinates like
// every rule's state), inside the parameter's own elements: a vector's variance element by element;
// a matrix's row_var at its elements [0, B·m) and col_var at [B·m, B·m + B·n), which fit because
// m + n <= m·n for m, n >= 2. When m or n is 1, that factor (one value per batch) is not stored:
// it equals the mean of the other (both are running means of the same g², and lerp is linear), so
// it is derived from the other each step, equal to torch's up to rounding. The buffer therefore
// has the flat layout's coordinates, and sharded checkpoints, resharding across N and stages 0-3
// need nothing of their own; it costs one state element per parameter (4 bytes in fp32, half of
// AdamW's 8), not the O(m + n) of a matrix, the price of those coordinates.
// A step (all of it on this rank's pieces, in the master dtype's precision for stored values):
//   1. locally, per parameter: sum of squares of the weights, and for matrices the partial row and
//      column sums of g² plus the factor values this rank stores; ONE all-reduce (sum) of all of
//      them (each stored element is owned by one rank, so the sum assembles the factors);
//   2. every rank lerps the full factors (O(m + n)), writes back the part it stores, and computes
//      its pieces' update g / sqrt(max(v̂, eps1²)) and its partial sum of squares; a second
//      all-reduce (the update's RMS clips it: torch's d);
//   3. the weights: decoupled weight decay, then minus alpha / max(1, RMS(u) / d) times u, with
//      alpha = max(eps2, RMS(w)) · min(lr, 1/sqrt(step)). The update is recomputed here, not kept:
//      Adafactor is chosen for its memory.
// Each phase runs parameters in parallel (at::parallel_for), each parameter's pieces in order on
// one thread, so the sums, and the result, do not depend on the number of threads.
// Replicated plans (stage 0) hold whole tensors and skip both all-reduces.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "engine/flat_state.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/rules.hpp"

namespace shardopt::detail {

// Where torch's Adafactor state of one parameter lives among its elements (the note above).
struct FactoredLayout {
  bool factored = false;               // two or more dimensions
  int64_t batches = 1, rows = 1, cols = 1;  // prod(shape[:-2]), shape[-2], shape[-1]
  bool row_stored = false, col_stored = false;

  int64_t row_numel() const { return batches * rows; }
  int64_t col_numel() const { return batches * cols; }
  int64_t col_at() const { return row_stored ? row_numel() : 0; }  // col_var's first element
};
FactoredLayout factored_layout(const std::vector<int64_t>& shape);

// torch's state of one parameter from its elements of the flat buffer (`packed`, the parameter's
// shape): {"row_var", "col_var"} shaped as torch shapes them, or {"variance"}.
std::map<std::string, at::Tensor> adafactor_torch_state(const at::Tensor& packed);
// The inverse: the parameter-shaped packed tensor from torch's state (checked: names, shapes).
at::Tensor adafactor_packed_state(const std::map<std::string, at::Tensor>& state,
                                  const std::vector<int64_t>& shape, const std::string& name,
                                  const at::TensorOptions& options);

class AdafactorUpdate {
 public:
  using RuleOf = std::function<const Rule&(int group)>;
  // `shapes`: each layout slot's parameter shape.
  AdafactorUpdate(FlatState& flat, CommunicatorPtr comm, Duration timeout, RuleOf rule_of,
                  const std::vector<std::vector<int64_t>>& shapes);
  // Optimizer step number `step` (1-based) over this rank's segments.
  void update(int64_t step);

 private:
  template <typename T>
  void update_typed(int64_t step);

  // One parameter's intersection with one segment: `begin` in the segment, `first` in the
  // parameter (its element offset).
  struct Piece {
    int segment;
    int64_t begin, length, first;
  };

  FlatState& flat_;
  CommunicatorPtr comm_;
  Duration timeout_;
  RuleOf rule_of_;
  std::vector<std::vector<Piece>> pieces_;  // per slot, this rank's pieces in segment order
  std::vector<int> touched_;                // the slots this rank holds a piece of
  std::vector<FactoredLayout> layouts_;  // per slot
  std::vector<int64_t> numel_;           // per slot
  std::vector<int64_t> stats_at_;        // per slot: its first value in the first all-reduce
  int64_t stats_numel_ = 0;
};

}  // namespace shardopt::detail
