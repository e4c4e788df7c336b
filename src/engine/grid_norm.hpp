// GridNorm: how one optimizer's gradient norm and non-finite flag reach beyond its data-parallel
// group over the model-parallel grid: the tensor group (parameters every tensor rank holds whole
// count 1/t on each) and the pipeline group (every stage's gradients). A pure measure: the sums
// that make the gradients final are FinalizeGrads' (engine/finalize_grads.hpp).
#pragma once

#include <string>
#include <vector>

#include "engine/finite_check.hpp"
#include "engine/flat_state.hpp"
#include "shardopt/comm.hpp"

namespace shardopt::detail {

struct ModelParam;

// The tensor group of an optimizer's parameters and which of them every tensor rank holds whole,
// read from their split records (Note [Split records] in shardopt/tensor_parallel.hpp).
struct TensorGrid {
  CommunicatorPtr group;          // null: no tensor parallelism
  std::vector<char> replicated;   // per slot (the parameters' order)
};
// `given`: ZeroOptions::tensor_group; null takes the records' group when one is split over more
// than one rank. Every record must name a group of the same size as the one used (Error
// InvalidArgument naming the parameter otherwise).
TensorGrid tensor_grid_of(const std::vector<ModelParam>& params, CommunicatorPtr given);

class GridNorm {
 public:
  GridNorm(FlatState& flat, CommunicatorPtr comm, Duration timeout)
      : flat_(flat), comm_(std::move(comm)), timeout_(timeout) {}

  // Tensor parallelism: `replicated[slot]` is held whole by every rank of `group`.
  void set_tensor_group(CommunicatorPtr group, std::vector<char> replicated);
  // Pipeline parallelism: the norm and the flag span every stage of `pipeline`.
  void set_pipeline(CommunicatorPtr pipeline) { pipeline_group_ = std::move(pipeline); }

  // `local`: this rank's scan of its final gradients (scan_local, in segment order). Returns the
  // grid's answer, the same on every rank of it.
  FiniteScan combine(FiniteScan local, bool norm);

 private:
  // Sum of squares of this rank's gradients of the replicated parameters.
  double replicated_sum_sq() const;
  FlatState& flat_;
  CommunicatorPtr comm_;  // the data-parallel group
  Duration timeout_;
  CommunicatorPtr tensor_group_;
  std::vector<char> replicated_;  // per slot
  CommunicatorPtr pipeline_group_;
};

}  // namespace shardopt::detail
