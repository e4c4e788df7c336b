// FlatState: coordinates, the master weights, the optimizer state and the update's segments.
#include "engine/flat_state.hpp"

#include <ATen/ATen.h>

namespace shardopt::detail {

FlatState::FlatState(StagePlan plan, FlatLayout layout, int rank,
                     const at::TensorOptions& model_options,
                     const at::TensorOptions& master_options,
                     const at::TensorOptions& reduce_options)
    : plan_(plan), layout_(std::move(layout)), rank_(rank), model_options_(model_options),
      master_options_(master_options), reduce_options_(reduce_options) {}

UpdatedRange FlatState::updated(int bucket) const {
  const auto& bl = layout_.buckets[bucket];
  if (!plan_.sharded()) return {0, bl.padded, bl.flat_offset};
  return {rank_ * bl.shard, bl.shard, bl.shard_offset};
}

int64_t FlatState::update_numel() const {
  return plan_.sharded() ? layout_.shard_numel : layout_.padded_numel;
}

int64_t FlatState::update_index(int bucket, int64_t element) const {
  const auto range = updated(bucket);
  return range.state_offset + element - range.bucket_begin;
}

void FlatState::init_master(const at::Tensor& initial) {
  if (!plan_.separate_master()) return;
  // `initial` is this rank's shard (per part) or full length; the master is in update coordinates.
  if (plan_.per_part() || !plan_.sharded()) {
    master_ = initial.to(master_options_, false, true);
    return;
  }
  master_ = at::empty({layout_.shard_numel}, master_options_);
  for (const auto& bl : layout_.buckets) {
    master_.narrow(0, bl.shard_offset, bl.shard)
        .copy_(initial.narrow(0, bl.flat_offset + rank_ * bl.shard, bl.shard));
  }
}

void FlatState::init_state(int count, double first_value) {
  for (int k = 0; k < count; ++k) state_.push_back(at::zeros({update_numel()}, master_options_));
  if (count > 0 && first_value != 0.0) state_[0].fill_(first_value);
}

void FlatState::build_segments(const SliceOf& model_slice, const SliceOf& grad_slice) {
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const auto range = updated(static_cast<int>(b));
    Segment s;
    s.bucket = static_cast<int>(b);
    s.group = layout_.buckets[b].group;
    s.bucket_begin = range.bucket_begin;
    s.state_offset = range.state_offset;
    at::Tensor model = model_slice(s.bucket, range);
    if (plan_.separate_master()) {
      s.param = master_.narrow(0, range.state_offset, range.length);
      s.low = model;
    } else {
      s.param = model;
    }
    s.grad = grad_slice(s.bucket, range);
    segments_.push_back(s);
  }
}

at::Tensor FlatState::owned_master_slice(int bucket) {
  if (!plan_.separate_master()) return {};
  const auto& bl = layout_.buckets[bucket];
  return master_.narrow(0, update_index(bucket, rank_ * bl.shard), bl.shard);
}

at::Tensor FlatState::owned_state_slice(int k, int bucket) {
  const auto& bl = layout_.buckets[bucket];
  return state_[k].narrow(0, update_index(bucket, rank_ * bl.shard), bl.shard);
}

int64_t FlatState::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& s : state_) bytes += static_cast<int64_t>(s.nbytes());
  if (master_.defined()) bytes += static_cast<int64_t>(master_.nbytes());
  return bytes;
}

}  // namespace shardopt::detail
