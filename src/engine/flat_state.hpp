// FlatState: the flat layout and the one coordinate system every piece of the engine uses, the
// tensor options of each kind of buffer, and what the local update owns: the master weights
// (when separate), the optimizer state buffers and the segments the update walks.
//
// Note [Flat layout]
// Trainable parameters (tied weights once, frozen ones left out) are sorted by parameter group
// and, within a group, placed in reverse registration order, roughly the order backward produces
// their gradients. They are packed into buckets of about bucket_bytes (when 0: Note [Default bucket
// size] in shardopt/detail/plan.hpp); a parameter larger than the space left fills the bucket and
// continues in the next, split at a multiple of world * align so that it stays one contiguous view
// of the full flat buffer. Bucket b covers [flat_offset, flat_offset + padded), padded to a
// multiple of world * align, and rank r owns its elements [r*S, (r+1)*S). Model parameters are
// views into flat storage, so the update needs no copy. A bucket is the unit of one collective
// (Note [Bucket completion] in gradient_reducer.hpp). The part of a bucket this rank updates (its
// "updated range") is the owned slice when the plan is sharded, the whole bucket when replicated;
// it sits at state_offset in every update-coordinate buffer (master, state, reduced gradients).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <functional>
#include <vector>

#include "shardopt/detail/plan.hpp"
#include "shardopt/detail/partition.hpp"

namespace shardopt::detail {

// One contiguous run the local update covers: a bucket's updated range.
struct Segment {
  int bucket = 0;
  int group = 0;
  int64_t bucket_begin = 0;  // first element, in bucket coordinates
  int64_t state_offset = 0;  // first element in update coordinates
  at::Tensor param;  // the update's target: master weights, or the model's own storage
  at::Tensor grad;   // reduced, averaged gradients
  at::Tensor low;    // separate master: the model's storage to cast the result into
};

struct UpdatedRange {
  int64_t bucket_begin = 0;  // in bucket coordinates
  int64_t length = 0;
  int64_t state_offset = 0;  // in update coordinates
};

class FlatState {
 public:
  FlatState(StagePlan plan, FlatLayout layout, int rank, const at::TensorOptions& model_options,
            const at::TensorOptions& master_options, const at::TensorOptions& reduce_options);

  const StagePlan& plan() const { return plan_; }
  const FlatLayout& layout() const { return layout_; }
  int rank() const { return rank_; }
  const at::TensorOptions& model_options() const { return model_options_; }
  const at::TensorOptions& master_options() const { return master_options_; }
  const at::TensorOptions& reduce_options() const { return reduce_options_; }

  UpdatedRange updated(int bucket) const;
  // Length of an update-coordinate buffer.
  int64_t update_numel() const;
  // Position of element `element` (bucket coordinates) of bucket `bucket` in update coordinates.
  int64_t update_index(int bucket, int64_t element) const;

  // Master weights (separate master only) from ParameterStore::adopt's initial values: the full
  // flat buffer, or this rank's shard when parameters are gathered per unit.
  void init_master(const at::Tensor& initial);
  // Optimizer state: `count` zero buffers, the first filled with `first_value`.
  void init_state(int count, double first_value);
  // One segment per bucket; the engine hands over where the model's and the gradients' updated
  // ranges live.
  using SliceOf = std::function<at::Tensor(int bucket, const UpdatedRange& range)>;
  void build_segments(const SliceOf& model_slice, const SliceOf& grad_slice);

  std::vector<Segment>& segments() { return segments_; }
  const std::vector<Segment>& segments() const { return segments_; }
  std::vector<at::Tensor>& state() { return state_; }
  const at::Tensor& master() const { return master_; }
  // Writable owned slices (checkpoint coordinates): of the master weights (undefined when the
  // model's storage is the master) and of optimizer state buffer k.
  at::Tensor owned_master_slice(int bucket);
  at::Tensor owned_state_slice(int k, int bucket);

  int64_t state_bytes() const;  // optimizer state (+ separate master)

 private:
  StagePlan plan_;
  FlatLayout layout_;
  int rank_ = 0;
  at::TensorOptions model_options_;   // the model's parameters: compute dtype, their device
  at::TensorOptions master_options_;  // master weights, state, reduced gradients
  at::TensorOptions reduce_options_;  // bucket buffers: the dtype gradients are reduced in
  at::Tensor master_;                 // separate master weights, update coordinates
  std::vector<at::Tensor> state_;     // optimizer state buffers, update coordinates
  std::vector<Segment> segments_;
};

// Calls fn(param index, begin, length, param_offset) for each parameter piece's intersection with
// segment `s`: `begin` relative to the segment, `param_offset` to the parameter's first element.
template <typename Fn>
void for_each_param_piece(const FlatLayout& layout, const Segment& s, Fn&& fn) {
  const ShardRange seg{s.bucket_begin, s.bucket_begin + s.param.numel()};
  for (int k : layout.buckets[s.bucket].pieces) {
    const auto& p = layout.pieces[k];
    const ShardRange piece = intersect(seg, {p.offset, p.offset + p.numel});
    if (!piece.empty()) {
      fn(p.param, piece.begin - seg.begin, piece.size(),
         p.param_offset + (piece.begin - p.offset));
    }
  }
}

}  // namespace shardopt::detail
