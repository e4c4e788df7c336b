// GradientReducer: owns the gradients from the moment autograd produces them until the update
// reads them, and the collectives that reduce them. Two sinks (StagePlan::Gradients):
//   InPlace:  a flat gradient buffer the parameters' .grad are views of; autograd accumulates into
//             it; each complete bucket is all-reduced (replicated) or reduce-scattered into its
//             owned slice in place, on the last micro-step.
//   Bucketed: each fresh .grad is copied, piece by piece (a parameter may span buckets), into
//             pooled bucket buffers (at most kMaxBuffers while buckets complete as they fill) and
//             freed; a complete bucket is reduced every micro-step and folded into the reduced
//             gradients (update coordinates, master precision and device).
// Reductions are sums; the division by world * micro-steps happens once, on the reduced values.
#pragma once

#include <ATen/core/Tensor.h>

#include <deque>
#include <functional>
#include <vector>

#include "engine/flat_state.hpp"
#include "shardopt/comm.hpp"

namespace shardopt::detail {

class GradientReducer {
 public:
  // params[i]: the tensor of layout slot i (its .grad is managed here).
  GradientReducer(const FlatState& flat, std::vector<at::Tensor> params, CommunicatorPtr comm,
                  bool overlap, Duration timeout);
  // Lets in-flight collectives land before the buffers they write go away.
  ~GradientReducer();

  // The reduced gradients of a bucket's updated range (the update's input).
  at::Tensor reduced(int bucket, const UpdatedRange& range) const;

  // Parameter `index`'s gradient arrived in micro-step `micro`: move it into the sink. After each
  // of its pieces is in, `piece_in(bucket)` runs (the engine launches the buckets this arrival
  // completed there, so a buffer is in flight before the next piece needs one).
  void accept(int index, int micro, const std::function<void(int bucket)>& piece_in);
  // Gradients set by hand, without backward through the hooks: take every defined .grad.
  void accept_manual();
  // Starts bucket's reduction for micro-step `micro` (completes it at once without overlap).
  void launch(int bucket, int micro);
  bool launched_in(int bucket, int micro) const;
  bool nothing_launched() const;
  int buckets() const { return static_cast<int>(buckets_.size()); }
  // Waits for every reduction and folds it in; the next step starts with nothing launched.
  void complete_all();
  // Reduced gradients to zero (unless `values` is false: they are zero already), .grad back to
  // the in-place views (or none).
  void zero(bool values = true);

  int64_t take_comm_elements();
  int64_t grad_bytes() const;    // gradients kept between backward and step
  int64_t buffer_bytes() const;  // the bucket pool (+ offload's pinned staging buffer)

 private:
  static constexpr int kMaxBuffers = 2;
  struct Bucket {
    int launched_micro = -1;  // micro-step of the last launch this step; -1: none yet
    WorkPtr work;
    int buffer = -1;  // Bucketed: pool index while filling or in flight
  };

  int acquire_buffer(int bucket);
  void complete(int bucket);

  const FlatState& flat_;
  const StagePlan plan_;
  std::vector<at::Tensor> params_;
  CommunicatorPtr comm_;
  bool overlap_ = true;
  Duration timeout_;
  int rank_ = 0;
  std::vector<Bucket> buckets_;
  at::Tensor grad_flat_;               // InPlace: full length, model dtype
  std::vector<at::Tensor> grad_views_;  // InPlace: each parameter's view of it
  at::Tensor grad_reduced_;            // Bucketed: update coordinates, master options
  std::vector<at::Tensor> pool_;       // Bucketed: bucket buffers
  at::Tensor host_staging_;            // offload of device gradients: pinned, one bucket
  std::vector<int> free_buffers_;
  std::deque<int> in_flight_;
  int64_t max_bucket_numel_ = 0;
  int64_t comm_elements_ = 0;
};

}  // namespace shardopt::detail
