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

  // Sums what spans the grid, in place, before anything reads the gradients. Returns the change
  // to this rank's scan (scan_local over its gradients, in segment order) that the sums made.
  FiniteScan run(bool norm);

 private:
  FlatState& flat_;
  Duration timeout_;
  CommunicatorPtr shared_group_;
  std::vector<char> shared_;        // per slot
  std::vector<int64_t> shared_at_;  // per slot: its offset in the summed buffer
  int64_t shared_numel_ = 0;
  bool contributes_ = false;
  bool counts_ = false;
};

}  // namespace shardopt::detail
