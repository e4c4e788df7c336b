// WholeParameters: the model's parameters in one flat buffer (stages 0-2).
#include "engine/whole_parameters.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: not reached through ATen.h on torch 2.6

#include <algorithm>

namespace shardopt::detail {

// Note [One copy at construction]: the flat buffer is one allocation, but its pages are touched
// only as it fills: each parameter is copied in (not on ranks that receive rank 0's values) and,
// when the model keeps the master's dtype and device, becomes its view at once, so its own storage
// is freed before the next is copied. The resident peak is about one model plus one parameter; an
// allocator that reserves (a device, the bench's tracker) still counts model plus flat buffer.
// (Stage 3: PartStore::adopt, bucket by bucket.)
at::Tensor WholeParameters::adopt(const at::TensorOptions& master_options, bool broadcast) {
  at::NoGradGuard no_grad;
  const auto& layout = flat_.layout();
  at::Tensor initial = at::empty({layout.padded_numel}, master_options);
  const auto& model_options = flat_.model_options();
  const bool same_storage = initial.dtype() == model_options.dtype() &&
                            initial.device() == model_options.device();
  const bool from_rank0 = broadcast && comm_->size() > 1;
  for (const auto& bl : layout.buckets) {  // padding: alignment gaps and each bucket's tail
    int64_t end = 0;
    for (int k : bl.pieces) {
      const auto& piece = layout.pieces[k];
      if (piece.offset > end) initial.narrow(0, bl.flat_offset + end, piece.offset - end).zero_();
      end = std::max(end, piece.offset + piece.numel);
    }
    if (bl.padded > end) initial.narrow(0, bl.flat_offset + end, bl.padded - end).zero_();
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& param = params_[i];
    const int slot_index = static_cast<int>(i);
    at::Tensor slot = initial.narrow(0, layout.flat_offset(slot_index), layout.slots[i].numel);
    if (!from_rank0 || rank_ == 0) slot.copy_(param.reshape(-1));
    if (same_storage) param.set_data(slot.view(param.sizes()));
  }
  if (from_rank0) comm_->broadcast(initial, 0, true)->wait(timeout_);
  flat_params_ = initial.to(model_options);  // no copy when nothing changes
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    p.set_data(flat_params_.narrow(0, layout.flat_offset(static_cast<int>(i)), p.numel())
                   .view(p.sizes()));  // same TensorImpl (autograd identity), our storage
  }
  return initial;
}

at::Tensor WholeParameters::model_slice(int bucket, const UpdatedRange& range) const {
  const auto& bl = flat_.layout().buckets[bucket];
  return flat_params_.narrow(0, bl.flat_offset + range.bucket_begin, range.length);
}

at::Tensor WholeParameters::owned_slice(int bucket) const {
  const auto& bl = flat_.layout().buckets[bucket];
  return flat_params_.narrow(0, bl.flat_offset + rank_ * bl.shard, bl.shard);
}

void WholeParameters::after_update() {
  if (plan_.gathers_after_update()) gather_owned();
}

void WholeParameters::gather_owned() {
  std::vector<WorkPtr> works;
  for (const auto& bl : flat_.layout().buckets) {
    at::Tensor range = flat_params_.narrow(0, bl.flat_offset, bl.padded);
    works.push_back(comm_->all_gather(range.narrow(0, rank_ * bl.shard, bl.shard), range, true));
    comm_elements_ += bl.padded;
  }
  for (auto& w : works) w->wait(timeout_);
}

}  // namespace shardopt::detail
