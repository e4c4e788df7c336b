// GradientReducer: owns the gradients from the moment autograd produces them until the update
// reads them, and the collectives that reduce them. Two sinks (StagePlan::Gradients):
//   InPlace:  a flat gradient buffer the parameters' .grad are views of; autograd accumulates into
//             it; each complete bucket is all-reduced or reduce-scattered in place, on the last
//             micro-step. Direct (one rank, Note [Gradients where autograd left them]): nothing
//             reduced; large gradients stay in the tensors autograd made, read there.
//   Bucketed: each fresh .grad is copied, piece by piece, into pooled bucket buffers (Note [Bucket
//             pool bound] in shardopt/detail/plan.hpp) and freed; a complete bucket is reduced
//             every micro-step and folded into the reduced gradients (update coordinates), or,
//             deferred, added into its buffer until the last micro-step (Note [Deferred
//             reduction]).
// Reductions are sums; LocalUpdate divides by world (and the loss scale) once, on reduced values.
//
// Note [Bucket completion]
// The reducer owns when a bucket is reduced. Each bucket counts down its pieces in every backward
// pass, and complete buckets are launched in layout order: a complete bucket waits for a started
// one before it, so the sequence of collectives does not follow the order the hooks fire in. A
// bucket no piece has reached yet does not hold back the ones after it: it belongs to parameters
// backward reaches later (stage 3 lays out units in forward order) or that get no gradient; it is
// launched once complete, or at the end of the pass. Overlap is decided in one place
// (launch_ready). When the pool is full with nothing in flight, started buckets that hold back a
// complete one are passed over (launched once complete) so the pool need not grow.

#pragma once

#include <ATen/core/Tensor.h>

#include <deque>
#include <functional>
#include <utility>
#include <vector>

#include "engine/flat_state.hpp"
#include "shardopt/comm.hpp"

namespace shardopt::detail {

// Direct: gradients at least this large are read where autograd left them, smaller ones copied
// (Note [Gradients where autograd left them]).
constexpr int64_t kInPlaceGradBytes = int64_t{32} << 20;

class GradientReducer {
 public:
  // params[i]: the tensor of layout slot i (its .grad is managed here).
  // `accumulation`: micro-steps per step (InPlace gradients are reduced on the last one only).
  // `direct`: InPlace at one rank, gradients left where autograd put them (Note [Gradients where
  // autograd left them]).
  GradientReducer(const FlatState& flat, std::vector<at::Tensor> params, CommunicatorPtr comm,
                  bool overlap, int accumulation, Duration timeout, bool direct = false);
  // Lets in-flight collectives land before the buffers they write go away.
  ~GradientReducer();

  // The reduced gradients of a bucket's updated range (the update's input); undefined when direct.
  at::Tensor reduced(int bucket, const UpdatedRange& range) const;
  // Direct: the update reads parameter `index`'s gradient here (contiguous, the model's dtype; after
  // the step's reduction, defined for every parameter).
  bool direct() const { return direct_; }
  const at::Tensor& param_grad(int index) const { return grad_views_[index]; }

  // Parameter `index`'s gradient arrived in micro-step `micro` (counted once per pass: the caller
  // drops duplicates): moves it into the sink, counts its pieces down and launches the buckets that
  // are due (Note [Bucket completion]).
  void accept(int index, int micro);
  // End of backward pass `micro`: reduces what is still pending when this micro-step reduces.
  void end_pass(int micro);

  // Under the handshake (Note [Pipeline handshake] in src/pipeline/runner.cpp) the step's
  // micro-steps (`accumulation`, v*m) come from the pipeline, and from here to the next start_over() a bucket is reduced once,
  // when every parameter in it had its chunk's last backward pass (or at the step's last pass),
  // not at every pass's end. The bucket pool (never under pipelines: the engine defers them)
  // keeps reducing every bucket every micro-step.
  void begin_pipeline(int accumulation);
  // Whether the next backward pass is its chunk's last in the step.
  void set_last_pass_of_chunk(bool last) { last_of_chunk_ = last; }
  // Back to grad_accumulation_steps (start_over() calls it).
  void end_pipeline() {
    accumulation_ = options_accumulation_;
    handshake_ = false;
    last_of_chunk_ = false;
  }
  // Nothing launched in this step: step() then reduces gradients set by hand with reduce_manual.
  bool nothing_launched() const;
  void reduce_manual(int micro);
  // Waits for every reduction and folds it in; the next step starts with nothing launched.
  void complete_all();
  // The next gradients start from zero (Note [Gradients start over without a zeroing pass]).
  void start_over();

  // Called with a bucket whose reduction for this step landed while backward runs (from accept()
  // or end_pass(), never from step()'s complete_all): its reduced gradients are final.
  void set_on_reduced(std::function<void(int bucket)> fn) { on_reduced_ = std::move(fn); }
  // Direct: called with a parameter whose gradient is final for the step, from its hook.
  void set_on_param_final(std::function<void(int param)> fn) { on_param_final_ = std::move(fn); }
  // InPlace: whether some parameter of `bucket` had its .grad written in place (its version
  // counter moved) after the bucket's reduced gradients went to on_reduced_ in this step
  // (Note [Gradients written after the check]).
  bool written_after_reduced(int bucket) const;

  int64_t take_comm_elements() { return std::exchange(comm_elements_, 0); }
  // Seconds end_pass() waited for in-place reductions (Note [Gradients are final when backward
  // returns]) since the last call.
  double take_backward_wait_s() { return std::exchange(backward_wait_s_, 0.0); }
  int64_t grad_bytes() const;    // gradients kept between backward and step
  int64_t buffer_bytes() const;  // the bucket pool (+ offload's pinned staging buffer)

 private:
  struct Bucket {
    int pieces = 0;           // parameter pieces in it
    int pending = 0;          // pieces still to arrive in this pass
    bool passed_over = false;  // this pass: no longer holds back the buckets after it
    int launched_micro = -1;  // micro-step of the last launch this step; -1: none yet
    WorkPtr work;
    int buffer = -1;  // Bucketed: pool index while filling or in flight
    bool folded = false;  // Bucketed: folded into grad_reduced_ in this step (next fold adds)
    int final_pieces = 0;  // handshake: pieces whose chunk had its last pass in this step
  };

  int buckets() const { return static_cast<int>(buckets_.size()); }
  bool reduces(int micro) const;
  // The rules of launch_ready(), with and without the handshake.
  bool launched(const Bucket& b, int micro) const;
  bool due(const Bucket& b) const;
  bool started(const Bucket& b) const;
  // Whether this arrival makes parameter `index`'s gradient final for the step.
  bool mark_final(int index);
  void launch_ready(int micro, bool pass_over);
  bool pass_over_waiting(int micro);
  void launch(int bucket, int micro);
  // hook_micro >= 0: called from a hook in that micro-step (it may pass over waiting buckets).
  int acquire_buffer(int bucket, int hook_micro = -1);
  void complete(int bucket);
  // InPlace: completes the buckets launched in micro-step `micro` whose reduction has landed.
  void complete_landed(int micro);

  // Direct: parameter `index`'s gradient `grad` (autograd's, or set by hand) becomes its sink.
  void adopt(int index, at::Tensor& grad);

  const FlatState& flat_;
  const StagePlan plan_;
  const bool direct_;
  std::vector<at::Tensor> params_;
  CommunicatorPtr comm_;
  bool overlap_ = true;
  int accumulation_ = 1;
  int options_accumulation_ = 1;  // grad_accumulation_steps, outside a pipeline step
  bool handshake_ = false;        // Note [Pipeline handshake], in place or deferred
  bool last_of_chunk_ = false;    // the current pass is its chunk's last in the step
  std::vector<char> final_;       // handshake: parameter i's gradient is final for the step
  Duration timeout_;
  int rank_ = 0;
  std::vector<Bucket> buckets_;
  std::vector<int> own_buffer_;  // deferred (Note [Deferred reduction]): each bucket's pool index
  int next_ = 0;  // first bucket not launched in this pass (layout order)
  at::Tensor grad_flat_;               // InPlace: full length, model dtype
  std::vector<at::Tensor> grad_views_;  // InPlace: each parameter's view of it (direct: its .grad)
  std::vector<char> written_;           // InPlace: the view holds this step's gradient
  std::vector<char> in_place_;  // direct: the sink is autograd's tensor, not the view
  std::vector<int64_t> reduced_version_;  // InPlace: the view's version when on_reduced_ saw it
  at::Tensor grad_reduced_;            // Bucketed: update coordinates, master options
  std::vector<at::Tensor> pool_;       // Bucketed: bucket buffers
  at::Tensor host_staging_;            // offload of device gradients: pinned, one bucket
  std::vector<int> free_buffers_;
  std::deque<int> in_flight_;
  std::vector<int> landing_;            // InPlace: buckets in flight
  std::function<void(int)> on_reduced_;
  std::function<void(int)> on_param_final_;
  bool in_backward_ = false;            // inside accept() / end_pass()
  int64_t max_bucket_numel_ = 0;
  int64_t comm_elements_ = 0;
  double backward_wait_s_ = 0.0;
};

}  // namespace shardopt::detail
