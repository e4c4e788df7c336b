// LocalUpdate: everything that happens to this rank's segments between the end of the reduction
// and the new parameters: unscaling, the non-finite check, global-norm clipping, and the update
// itself (native rules through the fused kernels or torch's ops, LAMB's two phases with its
// all-reduced per-tensor norms, Adafactor's all-reduced factors (adafactor_update.hpp), 8-bit
// AdamW's blockwise quantised moments (adam8bit_update.hpp), Muon's owner-orthogonalised
// matrices (muon_update.hpp), or a factory-built torch optimizer over the shard).
#pragma once

#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "engine/adafactor_update.hpp"
#include "engine/adam8bit_update.hpp"
#include "engine/finalize_grads.hpp"
#include "engine/finite_check.hpp"
#include "engine/flat_state.hpp"
#include "engine/fused_kernels.hpp"
#include "engine/grid_norm.hpp"
#include "engine/muon_update.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/optimizer_types.hpp"
#include "shardopt/rules.hpp"

namespace shardopt::detail {

class LocalUpdate {
 public:
  // The rule of parameter group g as the torch param group holds it now (LR schedulers).
  using RuleOf = std::function<const Rule&(int group)>;

  // With a factory, the factory's optimizer steps the segments; otherwise `rule`'s state buffers
  // are allocated in `flat`. `fused`: use the device's fused kernels where they accept a segment.
  // `shapes`: each layout slot's parameter shape (per-tensor rules: Adafactor).
  LocalUpdate(FlatState& flat, CommunicatorPtr comm, Duration timeout, const Rule& rule,
              const ShardOptimizerFactory& factory, RuleOf rule_of, bool fused,
              const std::vector<std::vector<int64_t>>& shapes);

  // Unscales and checks the segments of `bucket`, final before step() (Note [The non-finite check
  // during backward]); unscale_and_check, given the same divisor and norm, combines the result.
  void check_early(int bucket, double divisor, bool norm);
  // Reading parameter gradients: parameter `param`'s gradient is final for the step (its last
  // micro-step's backward made it): checked now, while it is likely still in cache; step() uses
  // the result unless the gradient was written since (its version counter moved).
  void check_param_early(int param, bool norm);
  // The gradients start over (step() taken or skipped, zero_grad()): nothing checked early.
  void forget_early();
  // `bucket`'s gradients were written after check_early saw them (Note [Gradients written after
  // the check] in gradient_reducer.cpp): unscale_and_check checks them again, not dividing twice.
  void recheck(int bucket);
  // Divides the reduced gradients by `divisor` (world * loss scale) and returns whether any rank
  // holds a non-finite one; with `norm`, their global L2 norm goes to stats.grad_norm (the same on
  // every rank), and the times to stats' unscale_s, check_s and check_backward_s.
  bool unscale_and_check(double divisor, bool norm, StepStats& stats);
  // Model parallelism: unscale_and_check first finalizes the gradients over the grid
  // (finalize_grads.hpp), then its norm and flag span the grid (grid_norm.hpp).
  FinalizeGrads& finalize() { return finalize_; }
  GridNorm& grid() { return grid_; }
  // Scales the gradients down to `max_norm` given their global `norm`; returns whether it did.
  bool clip(double max_norm, double norm);
  // Optimizer step number `step` (1-based) into the segments' params (and, where the kernels wrote
  // it, their compute-dtype copies); Muon's counters go to `stats` when given.
  void update(int64_t step, StepStats* stats = nullptr);
  // Separate master: casts the result into the model's storage where the kernels did not (also
  // after a checkpoint load overwrote the master weights).
  void write_back();

  // From now on each segment's gradients are read per parameter piece from `grad_of(param index)`
  // (contiguous, fp32) instead of the segments' flat slices (Note [Gradients where autograd left
  // them] in gradient_reducer.cpp). Only where `can_read_param_grads()`.
  using GradOf = std::function<const at::Tensor&(int param)>;
  void read_param_grads(GradOf grad_of);
  // Whether nothing but the check, the clip and the fused Adam/AdamW/SGD kernels read the
  // segments' gradients, which then need not be flat: a native rule, the host's fp32 kernels.
  static bool can_read_param_grads(const Rule& rule, bool factory, bool fused,
                                   const at::TensorOptions& master);

  // The factory-built torch optimizer (null for native rules): LR changes are handed to it.
  torch::optim::Optimizer* factory_optimizer() const { return inner_.get(); }
  // 8-bit AdamW's state (null for other rules): its buffers are not element-indexed.
  Adam8bitUpdate* adam8bit() const { return adam8bit_.get(); }

 private:
  bool fused_step(const Rule& rule, int64_t step, Segment& s, std::vector<at::Tensor>& st);
  bool fused_lamb(int64_t step, double* acc, at::Tensor& sums);
  void lamb_update(int64_t step);
  // Calls fn(param index, begin, length) for each parameter piece's intersection with a segment,
  // begin relative to the segment (LAMB's per-parameter partial sums add up across pieces).
  template <typename Fn>
  void for_each_param_piece(const Segment& s, Fn&& fn) const;
  // One segment's unscale (by 1/divisor) and check; a 16-bit unscale's time goes to *unscale_s.
  FiniteScan scan_segment(Segment& s, double divisor, bool norm, double* unscale_s) const;
  // Calls fn(begin, length, grad) over the segment's gradients: the flat slice whole, or (reading
  // parameter gradients) each parameter piece's part of its gradient, `begin` relative to s.
  template <typename Fn>
  void for_each_grad(const Segment& s, Fn&& fn) const;
  // The segment's gradients as one flat tensor (a copy when reading parameter gradients).
  at::Tensor flat_grad(const Segment& s) const;
  // Reading parameter gradients: every parameter's check, in layout order, early ones reused.
  FiniteScan scan_params(bool norm);

  FlatState& flat_;
  CommunicatorPtr comm_;
  Duration timeout_;
  FinalizeGrads finalize_;
  GridNorm grid_;
  RuleOf rule_of_;
  bool lamb_ = false;
  const FusedKernels* kernels_ = nullptr;
  std::unique_ptr<torch::optim::Optimizer> inner_;
  std::unique_ptr<AdafactorUpdate> adafactor_;
  std::unique_ptr<Adam8bitUpdate> adam8bit_;  // allocates its own state buffers
  std::unique_ptr<MuonUpdate> muon_;
  GradOf grad_of_;  // set: gradients read per parameter (read_param_grads)
  std::vector<char> low_done_;  // per segment: this step's update already wrote `low` (kernels)
  std::vector<std::vector<int>> bucket_segments_;  // bucket -> its segments
  std::vector<std::optional<FiniteScan>> early_;   // per segment: checked by check_early
  // Reading parameter gradients: per parameter, its check during backward and the gradient's
  // version counter then.
  std::vector<std::optional<FiniteScan>> param_early_;
  std::vector<int64_t> param_version_;
  std::vector<char> unscaled_;  // per segment: divided early, then written: check, do not divide
  double early_divisor_ = 0.0;
  bool early_norm_ = false;
  double early_s_ = 0.0;
};

}  // namespace shardopt::detail
