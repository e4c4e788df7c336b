// FinalizeGrads: what happens to the reduced gradients across the model-parallel grid before the
// norm and the update (Megatron's finalize_model_grads; Note [Finalizing gradients over the grid]).
// One owner: GridNorm only measures, the runner and the model only mark their tensors.
#pragma once

#include <vector>

#include "engine/finite_check.hpp"
#include "engine/flat_state.hpp"
#include "shardopt/comm.hpp"

namespace shardopt::detail {

class FinalizeGrads {
 public:
  FinalizeGrads(FlatState& flat, Duration timeout) : flat_(flat), timeout_(timeout) {}

  // Pipelines: `shared[slot]` is held by the first and the last stage, whose data-parallel ranks
  // form `group` (ParallelGroups::embedding, first stage first). `contributes`: this rank writes
  // its pieces into the sum (one copy of each reduced element over the data-parallel group);
  // `counts`: the norm counts the sum here (the first stage).
  void set_pipeline_shared(CommunicatorPtr group, std::vector<char> shared, bool contributes,
                           bool counts);

  // Sequence parallelism: `slots` (per slot) hold only this tensor rank's part of their gradient;
  // they are summed over `tensor_group` (Note [Sequence-parallel sums] in
  // src/parallel/split_record.cpp). Collective over the group: checks that every rank sums the
  // same elements.
  void set_sequence_parallel(CommunicatorPtr tensor_group, std::vector<char> slots);

  // Sums what spans the grid, in place, before anything reads the gradients. Returns the change
  // to this rank's scan (scan_local over its gradients, in segment order) that the sums made.
  FiniteScan run(bool norm);

 private:
  // This rank's pieces of the flagged slots summed over `group`: each piece is copied to its
  // place in one buffer (by `contributes`; the others' places stay zero), the buffer all-reduced
  // and read back. Adds the scans of the pieces before and after to `before` and `after`.
  void sum_pieces(const CommunicatorPtr& group, const std::vector<char>& slots,
                  const std::vector<int64_t>& at, int64_t numel, bool contributes, bool norm,
                  FiniteScan& before, FiniteScan& after);
  FlatState& flat_;
  Duration timeout_;
  CommunicatorPtr shared_group_;
  std::vector<char> shared_;        // per slot
  std::vector<int64_t> shared_at_;  // per slot: its offset in the summed buffer
  int64_t shared_numel_ = 0;
  bool contributes_ = false;
  bool counts_ = false;
  CommunicatorPtr tensor_group_;
  std::vector<char> sequence_;      // per slot
  std::vector<int64_t> sequence_at_;  // per slot: its first piece's offset in the summed buffer
  int64_t sequence_numel_ = 0;
};

}  // namespace shardopt::detail
