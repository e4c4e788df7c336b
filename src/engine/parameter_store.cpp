// ParameterStore: the model's parameter storage, whole or gathered per unit.
#include "engine/parameter_store.hpp"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>

#include "engine/release_guard.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail {

ParameterStore::ParameterStore(const FlatState& flat, std::vector<at::Tensor> params,
                               std::vector<std::string> names, std::vector<std::string> unit_names,
                               CommunicatorPtr comm, Duration timeout, int prefetch)
    : flat_(flat), plan_(flat.plan()), params_(std::move(params)), names_(std::move(names)),
      unit_names_(std::move(unit_names)), comm_(std::move(comm)), timeout_(timeout),
      prefetch_(prefetch), rank_(flat.rank()) {
  units_.resize(unit_names_.size());
  root_unit_ = static_cast<int>(units_.size()) - 1;
  units_[root_unit_].gathered = true;
}

ParameterStore::~ParameterStore() {
  for (const auto& u : units_) {
    for (int i : u.params) forget_parameter(params_[i]);
  }
  if (collective_timed_out()) return;  // nothing in flight can land; the engine holds the tensors
  for (auto& u : units_) {
    for (auto& w : u.works) {
      try {
        w->wait(timeout_);
      } catch (...) {
      }
    }
  }
}

void ParameterStore::adopt(const at::Tensor& initial) {
  at::NoGradGuard no_grad;
  const auto& layout = flat_.layout();
  const auto& options = flat_.model_options();
  if (plan_.per_unit()) {
    shard_ = flat_.owned_copy(initial, options);
    for (size_t b = 0; b < layout.buckets.size(); ++b) {
      const auto& bl = layout.buckets[b];
      full_.push_back(initial.narrow(0, bl.flat_offset, bl.padded).to(options, false, true));
      units_[bl.unit].buckets.push_back(static_cast<int>(b));
    }
  } else {
    flat_params_ = initial.to(options);  // no copy when nothing changes
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    const auto& slot = layout.slots[i];
    const auto& bl = layout.buckets[slot.bucket];
    at::Tensor view =
        plan_.per_unit()
            ? full_[slot.bucket].narrow(0, slot.offset, slot.numel).view(p.sizes())
            : flat_params_.narrow(0, bl.flat_offset + slot.offset, slot.numel).view(p.sizes());
    p.set_data(view);  // same TensorImpl (autograd identity), our storage
  }
  if (plan_.per_unit()) {
    for (size_t i = 0; i < params_.size(); ++i) {
      const int unit = layout.buckets[layout.slots[i].bucket].unit;
      if (unit == root_unit_) continue;
      units_[unit].params.push_back(static_cast<int>(i));
      remember_parameter(params_[i], names_[i], fmt::format("'{}'", unit_names_[unit]));
    }
  }
  // Stage 3 after construction: every unit but the root gives its full storage back.
  for (int u = 0; u < root_unit_; ++u) {
    units_[u].gathered = true;
    release(u);
  }
}

at::Tensor ParameterStore::model_slice(int bucket, const UpdatedRange& range) const {
  const auto& bl = flat_.layout().buckets[bucket];
  if (plan_.per_unit()) return shard_.narrow(0, bl.shard_offset, range.length);
  return flat_params_.narrow(0, bl.flat_offset + range.bucket_begin, range.length);
}

at::Tensor ParameterStore::owned_slice(int bucket) const {
  const auto& bl = flat_.layout().buckets[bucket];
  if (plan_.per_unit()) return shard_.narrow(0, bl.shard_offset, bl.shard);
  return flat_params_.narrow(0, bl.flat_offset + rank_ * bl.shard, bl.shard);
}

void ParameterStore::after_update() {
  if (plan_.per_unit()) {
    // Non-root units gather on demand; one gathered by hand holds stale values now.
    for (int u = 0; u < root_unit_; ++u) release(u);
    launch_gather(root_unit_);
    ensure_gathered(root_unit_);
    return;
  }
  if (!plan_.gathers_after_update()) return;
  std::vector<WorkPtr> works;
  for (const auto& bl : flat_.layout().buckets) {
    at::Tensor range = flat_params_.narrow(0, bl.flat_offset, bl.padded);
    works.push_back(comm_->all_gather(range.narrow(0, rank_ * bl.shard, bl.shard), range, true));
    comm_elements_ += bl.padded;
  }
  for (auto& w : works) w->wait(timeout_);
}

// ---- PerUnit (see Note [Stage 3 units]) -------------------------------------------------------

void ParameterStore::enter(int unit) {
  if (forward_order_.size() > 4 * units_.size() + 16) {  // forwards without backward (eval)
    previous_order_ = std::move(forward_order_);
    forward_order_.clear();
  }
  forward_order_.push_back(unit);
  if (unit != root_unit_) ensure_gathered(unit);
  // Prefetch what came next in the last pass (declaration order on the first pass).
  const size_t k = forward_order_.size() - 1;
  for (int i = 1; i <= prefetch_; ++i) {
    int next = -1;
    if (k + i < previous_order_.size()) {
      next = previous_order_[k + i];
    } else if (previous_order_.empty()) {
      next = unit + i;
    }
    if (next >= 0 && next < root_unit_ && !units_[next].gathered) launch_gather(next);
  }
}

void ParameterStore::exit(int unit) {
  if (unit != root_unit_) release(unit);
}

void ParameterStore::before_backward(int unit) {
  if (unit == root_unit_) return;
  ensure_gathered(unit);
  prefetch_after(unit);
}

// The units backward reaches next: those before `unit` in this pass's forward order.
void ParameterStore::prefetch_after(int unit) {
  auto it = std::find(forward_order_.rbegin(), forward_order_.rend(), unit);
  for (int i = 0; i < prefetch_ && it != forward_order_.rend(); ++i) {
    if (++it == forward_order_.rend()) break;
    if (*it != root_unit_ && !units_[*it].gathered) launch_gather(*it);
  }
}

void ParameterStore::end_backward() {
  // Units whose parameters got no gradient (or a prefetch nobody used) are freed here.
  for (int u = 0; u < root_unit_; ++u) release(u);
  previous_order_ = std::move(forward_order_);
  forward_order_.clear();
}

void ParameterStore::gather_full() {
  if (!plan_.per_unit()) return;
  for (int u = 0; u < root_unit_; ++u) {
    if (!units_[u].gathered) launch_gather(u);
  }
  for (int u = 0; u < root_unit_; ++u) ensure_gathered(u);
}

// Allocates the unit's full buffers and starts all-gathering its shards into them.
void ParameterStore::launch_gather(int unit) {
  auto& u = units_[unit];
  const auto& layout = flat_.layout();
  for (int i : u.params) unguard(params_[i]);
  for (int b : u.buckets) {
    const auto& bl = layout.buckets[b];
    at::Tensor& full = full_[b];
    auto* storage = full.storage().unsafeGetStorageImpl();
    if (storage->nbytes() == 0) {
      const size_t nbytes = static_cast<size_t>(full.numel()) * full.element_size();
      storage->set_data_ptr_noswap(c10::GetAllocator(full.device().type())->allocate(nbytes));
      storage->set_nbytes(nbytes);
    }
    u.works.push_back(comm_->all_gather(shard_.narrow(0, bl.shard_offset, bl.shard), full, true));
    comm_elements_ += bl.padded;
  }
  u.gathered = true;
}

void ParameterStore::ensure_gathered(int unit) {
  auto& u = units_[unit];
  if (!u.gathered) launch_gather(unit);
  for (auto& w : u.works) w->wait(timeout_);
  u.works.clear();
}

// Frees the unit's full storage (the parameters keep their shape, not their bytes).
void ParameterStore::release(int unit) {
  auto& u = units_[unit];
  if (!u.gathered) return;
  for (auto& w : u.works) w->wait(timeout_);  // never free under a collective
  u.works.clear();
  for (int b : u.buckets) full_[b].storage().unsafeGetStorageImpl()->reset();
  for (int i : u.params) guard_released(params_[i]);
  u.gathered = false;
}

int64_t ParameterStore::take_comm_elements() {
  const int64_t n = comm_elements_;
  comm_elements_ = 0;
  return n;
}

int64_t ParameterStore::param_bytes() const {
  return static_cast<int64_t>(plan_.per_unit() ? shard_.nbytes() : flat_params_.nbytes());
}

int64_t ParameterStore::gathered_bytes() const {
  int64_t bytes = 0;
  for (const auto& full : full_) bytes += static_cast<int64_t>(full.storage().nbytes());
  return bytes;
}

}  // namespace shardopt::detail
