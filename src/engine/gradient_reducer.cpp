// GradientReducer: the gradient sinks, the bucket pool and the reduction collectives.
#include "engine/gradient_reducer.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: not reached through ATen.h on torch 2.6

#include <algorithm>
#include <chrono>

#include "shardopt/error.hpp"

namespace shardopt::detail {

GradientReducer::GradientReducer(const FlatState& flat, std::vector<at::Tensor> params,
                                 CommunicatorPtr comm, bool overlap, int accumulation,
                                 Duration timeout, bool direct)
    : flat_(flat), plan_(flat.plan()), direct_(direct), params_(std::move(params)),
      comm_(std::move(comm)),
      overlap_(overlap), accumulation_(accumulation), options_accumulation_(accumulation),
      timeout_(timeout), rank_(flat.rank()) {
  const auto& layout = flat_.layout();
  buckets_.resize(layout.buckets.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    buckets_[b].pieces = buckets_[b].pending = static_cast<int>(layout.buckets[b].pieces.size());
    max_bucket_numel_ = std::max(max_bucket_numel_, layout.buckets[b].padded);
  }
  own_buffer_.assign(buckets_.size(), -1);
  final_.assign(params_.size(), 0);
  at::NoGradGuard no_grad;
  if (plan_.bucketed()) {
    grad_reduced_ = at::zeros({flat_.update_numel()}, flat_.master_options());
    for (auto& p : params_) p.mutable_grad().reset();
    return;
  }
  written_.assign(params_.size(), 0);
  reduced_version_.assign(params_.size(), -1);
  // Direct: only the copied gradients are ever written (the update reads pieces, never padding),
  // so the buffer's pages under gradients read in place are never touched.
  grad_flat_ = direct_ ? at::empty({layout.padded_numel}, flat_.model_options())
                       : at::zeros({layout.padded_numel}, flat_.model_options());
  in_place_.assign(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    in_place_[i] = direct_ && params_[i].numel() * params_[i].element_size() >= kInPlaceGradBytes;
    // Aliases of the flat buffer that are not autograd views: torch 1.13's C++
    // Optimizer::zero_grad calls detach_() on every .grad, which autograd refuses for views.
    grad_views_.push_back(at::empty({0}, grad_flat_.options())
                              .set_(grad_flat_.storage(), layout.flat_offset(static_cast<int>(i)),
                                    params_[i].sizes(), {}));
    params_[i].mutable_grad().reset();  // Note [Gradients start over without a zeroing pass]
  }
}

GradientReducer::~GradientReducer() {
  if (collective_timed_out()) return;  // nothing in flight can land; the engine holds the tensors
  for (auto& b : buckets_) {
    if (!b.work) continue;
    try {
      b.work->wait(timeout_);
    } catch (...) {
    }
  }
}

at::Tensor GradientReducer::reduced(int bucket, const UpdatedRange& range) const {
  if (direct_) return at::Tensor();
  if (plan_.bucketed()) return grad_reduced_.narrow(0, range.state_offset, range.length);
  const auto& bl = flat_.layout().buckets[bucket];
  return grad_flat_.narrow(0, bl.flat_offset + range.bucket_begin, range.length);
}

namespace {
// The tensor's version counter, read without a dispatch (Tensor::_version() is an operator).
int64_t version_of(const at::Tensor& t) {
  return static_cast<int64_t>(t.unsafeGetTensorImpl()->version_counter().current_version());
}

// Marks the reducer's calls from autograd's side (Note [The non-finite check during backward]).
struct InBackward {
  explicit InBackward(bool& flag) : flag_(flag) { flag_ = true; }
  ~InBackward() { flag_ = false; }
  bool& flag_;
};
}  // namespace

void GradientReducer::accept(int index, int micro) {
  InBackward in_backward(in_backward_);
  const auto& layout = flat_.layout();
  // Its pieces count as final one by one, as they reach their buckets (a bucketed piece must be
  // in its buffer before the bucket can go out).
  const bool final = handshake_ && mark_final(index);
  at::Tensor& grad = params_[index].mutable_grad();
  if (!plan_.bucketed()) {
    // Autograd accumulated in place unless .grad was not the view (the first gradient of the
    // step, or someone replaced it): copy it in or fold it in.
    const at::Tensor& view = grad_views_[index];
    if (in_place_[index]) {
      adopt(index, grad);
    } else if (grad.defined() && !grad.is_same(view) && grad.data_ptr() != view.data_ptr()) {
      if (written_[index]) {
        view.add_(grad);
      } else {
        view.copy_(grad);
      }
    } else if (!written_[index]) {
      view.zero_();  // no gradient: autograd found no .grad to fill
    }
    written_[index] = 1;
    grad = grad_views_[index];
    if (direct_ && on_param_final_ && reduces(micro)) on_param_final_(index);
    for (const ParamPiece* p = layout.pieces_begin(index); p != layout.pieces_end(index); ++p) {
      --buckets_[p->bucket].pending;
      if (final) ++buckets_[p->bucket].final_pieces;
    }
    launch_ready(micro, /*pass_end=*/false);
    complete_landed(micro);
    return;
  }
  const at::Tensor flat = grad.defined() ? grad.reshape(-1) : at::Tensor();
  for (const ParamPiece* p = layout.pieces_begin(index); p != layout.pieces_end(index); ++p) {
    auto& b = buckets_[p->bucket];
    // Last micro-step's reduction of this bucket must land before its buffer refills.
    if (b.work && b.launched_micro != micro) complete(p->bucket);
    at::Tensor dst = pool_[acquire_buffer(p->bucket, micro)].narrow(0, p->offset, p->numel);
    if (plan_.accumulates_in_buckets()) {  // Note [Deferred reduction]: zeroed when acquired
      if (flat.defined()) dst.add_(flat.narrow(0, p->param_offset, p->numel));
    } else if (flat.defined()) {
      dst.copy_(flat.narrow(0, p->param_offset, p->numel));
    } else {
      dst.zero_();
    }
    --b.pending;
    if (final) ++b.final_pieces;
    // Piece by piece: a bucket this piece completes is launched before the next piece needs a
    // buffer, so the pool keeps its bound however many buckets the parameter spans.
    launch_ready(micro, /*pass_end=*/false);
  }
  grad.reset();  // the full gradient is freed as soon as it is in the buckets
}

bool GradientReducer::reduces(int micro) const {
  return plan_.reduces_every_micro_step() || micro + 1 >= accumulation_ ||
         (handshake_ && last_of_chunk_);
}

// A parameter's gradient is final after its chunk's last pass (Note [Pipeline handshake] in
// src/pipeline/runner.cpp). One that reaches a bucket already launched came from a later pass of
// another chunk: a parameter used by two chunks of one rank, whose last pass is not known.
bool GradientReducer::mark_final(int index) {
  const auto& layout = flat_.layout();
  for (const ParamPiece* p = layout.pieces_begin(index); p != layout.pieces_end(index); ++p) {
    SHARDOPT_CHECK(buckets_[p->bucket].launched_micro < 0, Unsupported,
                   "optimizer: parameter {} of the layout got a gradient after its bucket was "
                   "reduced for the step, at the last backward pass of the chunk that first "
                   "used it; under run_pipeline's optimizer handshake each parameter belongs to "
                   "one chunk of the rank (Note [Pipeline handshake])",
                   index);
  }
  if (!last_of_chunk_ || final_[index]) return false;
  final_[index] = 1;
  return true;
}

void GradientReducer::begin_pipeline(int accumulation) {
  accumulation_ = accumulation;
  handshake_ = !plan_.reduces_every_micro_step();
  last_of_chunk_ = false;
}

// Without the handshake a bucket goes out once per reducing pass: when its pieces of the pass are
// in, or at the pass's end. With it (in place, deferred), once per step: when every piece is
// final, or at the step's last pass.
bool GradientReducer::launched(const Bucket& b, int micro) const {
  return handshake_ ? b.launched_micro >= 0 : b.launched_micro == micro;
}
bool GradientReducer::due(const Bucket& b) const {
  return handshake_ ? b.final_pieces == b.pieces : b.pending == 0;
}
bool GradientReducer::started(const Bucket& b) const {
  return handshake_ ? b.final_pieces > 0 : b.pending < b.pieces;
}

// Note [Bucket completion]: the one place that decides when buckets go out. Without overlap_comm,
// in-place gradients wait for the end of the pass (they hold no buffer); bucketed ones go out as
// they complete and are waited for at once (as DeepSpeed's overlap_comm=false), so the pool keeps
// its bound (Note [Bucket pool bound]).
void GradientReducer::launch_ready(int micro, bool pass_end) {
  if (!reduces(micro) || (!overlap_ && !pass_end && !plan_.bucketed())) return;
  // A pass's end flushes every bucket, but under the handshake (Note [Pipeline handshake]) only
  // the step's last pass does: a chunk's last pass launches those that are due.
  const bool flush = pass_end && (!handshake_ || micro + 1 >= accumulation_);
  for (int b = next_; b < buckets(); ++b) {
    auto& k = buckets_[b];
    if (!launched(k, micro) && (flush || due(k))) {
      launch(b, micro);
      if (!overlap_) complete(b);
    }
    if (launched(k, micro)) {
      if (b == next_) ++next_;
    } else if (!pass_end && started(k) && !k.passed_over) {
      break;  // started, not complete: holds back the buckets after it
    }
  }
}

// The pool is full and nothing is in flight: a complete bucket waiting behind started ones is
// launched, passing over those (launched once complete). Returns whether one went out.
bool GradientReducer::pass_over_waiting(int micro) {
  if (!overlap_ || !reduces(micro)) return false;
  int first_complete = next_;
  while (first_complete < buckets() && (buckets_[first_complete].launched_micro == micro ||
                                        buckets_[first_complete].pending > 0)) {
    ++first_complete;
  }
  if (first_complete == buckets()) return false;
  for (int b = next_; b < first_complete; ++b) buckets_[b].passed_over = true;
  launch_ready(micro, /*pass_end=*/false);
  return !in_flight_.empty();
}

// Note [Gradients are final when backward returns]
// In place, .grad is the parameter's view of the buffer the collective reduces, so a reduction
// still in flight after backward races with a trainer that reads or writes .grad before step()
// (its own clipping, logging, gradient surgery): it would read partial sums, and its writes could
// land anywhere, since MPI may use the buffer as workspace (OpenMPI's Bruck all-gather rotates the
// blocks through it: a NaN written into one parameter surfaced in the padding of another chunk and
// stayed there, skipping every later step). So, as DDP's reducer does in autograd's final
// callback, the pass that reduces waits for its buckets before backward returns. The wait only
// moves from step() to here; bucketed gradients live in buffers no .grad reaches.
void GradientReducer::end_pass(int micro) {
  InBackward in_backward(in_backward_);
  launch_ready(micro, /*pass_end=*/true);
  // Under the handshake, buckets launched at a chunk's last pass land while the other chunks'
  // passes run (they write other buckets' ranges); the step's last pass waits for them all.
  if (!plan_.bucketed() && micro + 1 >= accumulation_) {
    const auto t = std::chrono::steady_clock::now();
    for (const int b : landing_) buckets_[b].work->wait(timeout_);
    backward_wait_s_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    for (const int b : std::vector<int>(landing_)) complete(b);  // checks them (on_reduced_)
  }
  next_ = 0;
  for (auto& b : buckets_) {
    b.pending = b.pieces;
    b.passed_over = false;
  }
}

// Gradients set by hand reach the sinks as from backward. Bucketed: each bucket is launched as
// soon as it is filled, as accept() does, so the pool keeps its bound (Note [Bucket pool bound]).
void GradientReducer::reduce_manual(int micro) {
  const auto& layout = flat_.layout();
  if (!plan_.bucketed()) {
    for (size_t i = 0; i < params_.size(); ++i) {
      at::Tensor& g = params_[i].mutable_grad();
      if (in_place_[i]) {
        adopt(static_cast<int>(i), g);
        continue;
      }
      const at::Tensor& view = grad_views_[i];
      if (g.defined() && g.data_ptr() != view.data_ptr()) {
        view.copy_(g);
      } else if (!g.defined() && !written_[i]) {
        view.zero_();
      }
      written_[i] = 1;
      g = view;
    }
    for (int b = 0; b < buckets(); ++b) launch(b, micro);
    return;
  }
  for (int b = 0; b < buckets(); ++b) {
    const at::Tensor buffer = pool_[acquire_buffer(b)];  // zeroed: missing gradients count as 0
    for (const int k : layout.buckets[b].pieces) {
      const ParamPiece& p = layout.pieces[k];
      at::Tensor& g = params_[p.param].mutable_grad();
      if (!g.defined()) continue;
      buffer.narrow(0, p.offset, p.numel).copy_(g.reshape(-1).narrow(0, p.param_offset, p.numel));
      if (&p + 1 == layout.pieces_end(p.param)) g.reset();
    }
    launch(b, micro);
    if (!overlap_) complete(b);  // as launch_ready does without overlap
  }
}

// A bucket buffer from the pool; when all are busy, the oldest in-flight bucket is completed and
// its buffer reused, or (from a hook, nothing in flight) complete buckets waiting behind an
// incomplete one are launched. Buckets waiting for late or missing gradients keep their buffers;
// when two do and a third needs one, the pool grows (Note [Bucket pool bound]).
int GradientReducer::acquire_buffer(int bucket, int hook_micro) {
  auto& b = buckets_[bucket];
  if (b.buffer >= 0) return b.buffer;
  if (plan_.accumulates_in_buckets()) {  // Note [Deferred reduction]: a buffer of its own size
    const int64_t padded = flat_.layout().buckets[bucket].padded;
    if (own_buffer_[bucket] < 0) {
      pool_.push_back(at::empty({padded}, flat_.reduce_options()));
      own_buffer_[bucket] = static_cast<int>(pool_.size()) - 1;
    }
    b.buffer = own_buffer_[bucket];
    pool_[b.buffer].zero_();  // the step's first gradient adds into zeros
    return b.buffer;
  }
  int index = -1;
  if (!free_buffers_.empty()) {
    index = free_buffers_.back();
    free_buffers_.pop_back();
  } else if (static_cast<int>(pool_.size()) >= kBucketPoolBuffers &&
             (!in_flight_.empty() || (hook_micro >= 0 && pass_over_waiting(hook_micro)))) {
    complete(in_flight_.front());
    index = free_buffers_.back();
    free_buffers_.pop_back();
  } else {
    pool_.push_back(at::empty({max_bucket_numel_}, flat_.reduce_options()));
    index = static_cast<int>(pool_.size()) - 1;
  }
  b.buffer = index;
  // Parameters that never report a gradient this micro-step count as zero, as does padding.
  pool_[index].narrow(0, 0, flat_.layout().buckets[bucket].padded).zero_();
  return index;
}

void GradientReducer::launch(int bucket, int micro) {
  auto& b = buckets_[bucket];
  const auto& bl = flat_.layout().buckets[bucket];
  // A bucket no gradient reached in this micro-step (the other chunk's of an interleaved
  // pipeline, flushed at the pass's end) may still be landing from the last one: as in accept(),
  // that reduction lands before the bucket goes out again.
  if (b.work && b.launched_micro != micro) complete(bucket);
  // A second launch would drop the first's work while landing_ still lists the bucket.
  SHARDOPT_INTERNAL_ASSERT(!b.work, "bucket {} launched again while its reduction is in flight",
                           bucket);
  b.launched_micro = micro;
  at::Tensor range;
  if (plan_.bucketed()) {
    range = pool_[acquire_buffer(bucket)].narrow(0, 0, bl.padded);
    in_flight_.push_back(bucket);
  } else {
    // Parameters that got no gradient in this step hold the last step's values: zero them.
    for (int i : bl.params) {
      if (written_[i]) continue;
      at::NoGradGuard no_grad;
      if (in_place_[i]) {
        at::Tensor none;
        adopt(i, none);
        params_[i].mutable_grad() = grad_views_[i];
        continue;
      }
      grad_views_[i].zero_();
      params_[i].mutable_grad() = grad_views_[i];
      written_[i] = 1;
    }
    landing_.push_back(bucket);
    if (direct_) {  // one rank: nothing to reduce
      b.work = make_completed_work("direct gradients");
      return;
    }
    range = grad_flat_.narrow(0, bl.flat_offset, bl.padded);
  }
  if (!plan_.sharded()) {
    b.work = comm_->all_reduce(range, ReduceOp::Sum, true);
    comm_elements_ += 2 * bl.padded;
  } else {
    b.work = comm_->reduce_scatter(range, range.narrow(0, rank_ * bl.shard, bl.shard),
                                   ReduceOp::Sum, true);
    comm_elements_ += bl.padded;
  }
}

bool GradientReducer::nothing_launched() const {
  return std::all_of(buckets_.begin(), buckets_.end(),
                     [](const Bucket& b) { return b.launched_micro < 0; });
}

// Waits for a bucket's reduction; Bucketed, folds it into the reduced gradients, frees the buffer.
void GradientReducer::complete(int bucket) {
  auto& b = buckets_[bucket];
  if (!b.work) return;
  b.work->wait(timeout_);
  b.work.reset();
  // Landed while backward runs, in the step's last micro-step: these gradients are final.
  const bool final = in_backward_ && on_reduced_ &&
                     (handshake_ || b.launched_micro + 1 >= accumulation_);
  if (!plan_.bucketed()) {
    const auto it = std::find(landing_.begin(), landing_.end(), bucket);
    if (it != landing_.end()) landing_.erase(it);
    if (final) {
      for (int i : flat_.layout().buckets[bucket].params) {
        reduced_version_[i] = version_of(grad_views_[i]);
      }
      on_reduced_(bucket);
    }
    return;
  }
  const auto range = flat_.updated(bucket);
  at::Tensor reduced = pool_[b.buffer].narrow(0, range.bucket_begin, range.length);
  at::Tensor into = grad_reduced_.narrow(0, range.state_offset, range.length);
  if (reduced.device() != into.device()) {
    // Offload: device -> host through one pinned staging buffer (DMA at full speed, no fresh
    // pageable pages per bucket), then added in master precision.
    if (host_staging_.numel() < max_bucket_numel_) {
      host_staging_ = at::empty({max_bucket_numel_},
                                reduced.options().device(at::kCPU).pinned_memory(true));
    }
    reduced = host_staging_.narrow(0, 0, range.length).copy_(reduced);
  }
  // The first fold of the step copies (Note [Gradients start over without a zeroing pass]).
  if (b.folded) {
    into.add_(reduced);
  } else {
    into.copy_(reduced);
  }
  b.folded = true;
  if (!plan_.accumulates_in_buckets()) free_buffers_.push_back(b.buffer);
  b.buffer = -1;
  in_flight_.erase(std::find(in_flight_.begin(), in_flight_.end(), bucket));
  if (final) on_reduced_(bucket);
}

void GradientReducer::complete_landed(int micro) {
  if (!on_reduced_ || !reduces(micro)) return;
  for (size_t k = 0; k < landing_.size();) {
    const int b = landing_[k];
    if (buckets_[b].launched_micro == micro && buckets_[b].work->is_completed()) {
      complete(b);  // erases it from landing_
    } else {
      ++k;
    }
  }
}

void GradientReducer::complete_all() {
  for (size_t b = 0; b < buckets_.size(); ++b) complete(static_cast<int>(b));
  for (size_t b = 0; b < buckets_.size(); ++b) {
    auto& k = buckets_[b];
    k.launched_micro = -1;
    // Every bucket is launched (and so folded) in each step; should one not be, its range must
    // not keep the last step's gradients.
    if (plan_.bucketed() && !k.folded) {
      const auto range = flat_.updated(static_cast<int>(b));
      grad_reduced_.narrow(0, range.state_offset, range.length).zero_();
      k.folded = true;
    }
  }
}

// Note [Gradients start over without a zeroing pass]
// Zeroing the gradient sinks after each step would write every gradient element once more (stage
// 0, 21M fp32 parameters: a third of step()). Instead the first write of a step replaces what is
// there, as c10d's reducer does: in place, .grad is left undefined, autograd hands the first
// gradient over as a fresh tensor and accept() copies it into the parameter's view (and sets .grad
// to it, so later micro-steps accumulate in place); parameters that got none are zeroed when their
// bucket is launched. Bucketed, a bucket's first fold copies instead of adding. Between steps .grad
// is undefined (torch's set_to_none). Reductions still in flight after a backward no step()
// consumed (zero_grad() discards it) land and are dropped here: folded into the next step they
// would corrupt it, and their buckets would be launched twice.
void GradientReducer::start_over() {
  at::NoGradGuard no_grad;
  for (auto& b : buckets_) {
    if (b.work) {
      b.work->wait(timeout_);
      b.work.reset();
    }
    if (b.buffer >= 0) {
      if (!plan_.accumulates_in_buckets()) free_buffers_.push_back(b.buffer);
      b.buffer = -1;
    }
    b.launched_micro = -1;
    b.folded = false;
    b.final_pieces = 0;
  }
  std::fill(final_.begin(), final_.end(), 0);
  end_pipeline();
  in_flight_.clear();
  landing_.clear();
  std::fill(written_.begin(), written_.end(), 0);
  std::fill(reduced_version_.begin(), reduced_version_.end(), -1);
  backward_wait_s_ = 0.0;
  for (auto& p : params_) p.mutable_grad().reset();
  for (size_t i = 0; i < in_place_.size(); ++i) {
    if (in_place_[i]) grad_views_[i].reset();
  }
}

// Note [Gradients where autograd left them]
// At one rank there is nothing to reduce, so the flat buffer is only where the update finds the
// gradients. Direct, the update and the non-finite check read each parameter's gradient where its
// sink is (LocalUpdate::read_param_grads: kernels per parameter piece, never the padding), and
// nothing is reduced. The sink is chosen per parameter by size:
// - at least kInPlaceGradBytes: the tensor autograd made for its .grad (later micro-steps
//   accumulate into it in place). Copying it would be a round trip through memory of its whole
//   size (10^8 parameters: 45 ms of a 380 ms loop), and glibc maps an allocation that large fresh
//   at every backward whatever we do (its largest dynamic mmap threshold is 32 MiB). .grad is reset
//   after the step, as torch's set_to_none does.
// - smaller: its view of the flat buffer, copied in by its hook as before. The copy reads a
//   gradient that is still in cache, and freeing autograd's tensor at once lets the allocator give
//   the same memory to the next gradient: on BERT-base's 199 tensors the loop then takes no page
//   fault, where torch's, freeing every gradient at zero_grad(), faults on ~270 MB per step.
// Each parameter's gradient is checked by its hook as it arrives, while it is in cache
// (LocalUpdate::check_param_early). A gradient that is not contiguous or not in the model's dtype
// and device is converted once; a parameter with none gets zeros, as in place. Chosen by the
// engine where nothing else reads the segments' flat gradients: one rank, fp32 on the host, a rule
// the fused kernels step (Adam, AdamW, SGD), no factory, no model-parallel grid
// (Engine::reads_param_grads).
void GradientReducer::adopt(int index, at::Tensor& grad) {
  at::NoGradGuard no_grad;
  at::Tensor& sink = grad_views_[index];
  const auto& options = flat_.model_options();
  if (grad.defined() && !grad.is_same(sink)) {
    at::Tensor g = grad;
    if (!g.is_contiguous() || g.scalar_type() != options.dtype().toScalarType() ||
        g.device() != options.device() || g.sizes() != params_[index].sizes()) {
      g = g.to(options, /*non_blocking=*/false, /*copy=*/false).contiguous().view(
          params_[index].sizes());
    }
    if (written_[index] && sink.defined()) {
      sink.add_(g);
    } else {
      sink = g;
    }
  } else if (!written_[index] || !sink.defined()) {
    sink = at::zeros(params_[index].sizes(), options);  // no gradient: counts as zero
  }
  written_[index] = 1;
  grad = sink;
}

// Note [Gradients written after the check]
// In place, a parameter's .grad is its view of the flat buffer from its first gradient of the step
// on: a trainer may still write it after backward (gradient surgery, its own clipping, a NaN set
// by hand) before step() reads it, so a bucket checked during backward (Note [The non-finite check
// during backward] in local_update.cpp) is only trusted while every view in it keeps the version
// it had then. Every in-place write through .grad or a view of it moves the version counter, as
// autograd's saved-tensor check relies on; writes through .data or a raw pointer bypass it there
// as here. Our own writes after the check go through other aliases (the scan's unscale through
// the segment's slice), and bucketed gradients live in buffers no .grad reaches.
bool GradientReducer::written_after_reduced(int bucket) const {
  if (plan_.bucketed()) return false;
  for (int i : flat_.layout().buckets[bucket].params) {
    if (reduced_version_[i] >= 0 &&
        version_of(grad_views_[i]) != reduced_version_[i]) {
      return true;
    }
  }
  return false;
}

int64_t GradientReducer::grad_bytes() const {
  if (grad_flat_.defined()) return static_cast<int64_t>(grad_flat_.nbytes());
  return static_cast<int64_t>(grad_reduced_.nbytes());
}

int64_t GradientReducer::buffer_bytes() const {
  int64_t bytes = 0;
  for (const auto& b : pool_) bytes += static_cast<int64_t>(b.nbytes());
  if (host_staging_.defined()) bytes += static_cast<int64_t>(host_staging_.nbytes());
  return bytes;
}

}  // namespace shardopt::detail
