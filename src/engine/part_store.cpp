// PartStore: stage 3's parameter storage, gathered per part on request.
//
// Note [Part lifecycle]
// Below the Units API the engine gathers parts (Note [Stage 3 units] in engine.cpp): a declared
// unit needs one or more parts, automatic units are parts. Each part is in one PartState, changed
// only by transition(), which asserts that the change is one of:
//   Released         -> Gathering          launch_gather: storage allocated, all-gathers started
//   Gathering        -> Gathered           gather_part: every all-gather waited for
//   Gathered         -> NeededInBackward   gather_for_backward: backward reached it (not the root)
//   Gathered         -> Released           release: storage freed, parameters guarded
//   NeededInBackward -> Released           release: its gradients are in (or the pass ended)
// Storage is never freed under a collective: release() of a Gathering part finishes the gather
// first. NeededInBackward lets a forward run inside backward (a recomputation) end without freeing
// the part backward still reads. The store has no policy: the schedulers decide (Note [One owner
// of releases]).
//
// Note [Persistent parameters]
// A persistent part (automatic units' root part: UnitPolicy's small groups, within its
// persist_share of the model) is Gathered for good, and this rank's shard of its buckets is a view
// into its full buffer, not a second copy: the update writes the owned slice there (or the
// write-back casts into it) and after_update() all-gathers each bucket in place, as
// WholeParameters does. So a persistent parameter costs P bytes as at stage 2, never the P + P/N of
// a gathered copy beside a shard; its parameters carry no guard key, so operations on them cost
// nothing extra. The other parts' shards are packed in shard_. Declared units' root part is not
// persistent: it is gathered from zero_grad() to step().
#include "engine/part_store.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: not reached through ATen.h on torch 2.6
#include <c10/core/CPUAllocator.h>

#include <algorithm>

#include "engine/release_guard.hpp"
#include "shardopt/error.hpp"
#include "shardopt/memory_tracker.hpp"

namespace shardopt::detail {

PartStore::PartStore(const FlatState& flat, std::vector<at::Tensor> params,
                     std::vector<std::string> names, std::vector<std::string> part_labels,
                     CommunicatorPtr comm, Duration timeout, bool root_persists)
    : ParameterStore(flat, std::move(params), std::move(comm), timeout), names_(std::move(names)),
      part_labels_(std::move(part_labels)) {
  parts_.resize(part_labels_.size());
  root_part_ = static_cast<int>(parts_.size()) - 1;
  parts_[root_part_].persistent = root_persists;
  for (size_t p = 0; p < parts_.size(); ++p) {
    parts_[p].memory_tag = MemoryScope::tag(
        parts_[p].persistent ? "persistent parameters" : "gathered parts", part_labels_[p]);
  }
}

const char* part_state_name(PartState state) {
  switch (state) {
    case PartState::Released: return "Released";
    case PartState::Gathering: return "Gathering";
    case PartState::Gathered: return "Gathered";
    case PartState::NeededInBackward: return "NeededInBackward";
  }
  return "?";
}

PartStore::~PartStore() {
  registrations_.clear();
  for (const auto& part : parts_) {
    for (int i : part.params) forget_parameter(params_[i]);
  }
  if (collective_timed_out()) return;  // nothing in flight can land; the engine holds the tensors
  for (auto& part : parts_) {
    for (auto& w : part.works) {
      try {
        w->wait(timeout_);
      } catch (...) {
      }
    }
  }
}

// The parameters move into this rank's shard bucket by bucket, each parameter's own storage given
// back after its last bucket, so construction holds the model once plus the shard and one bucket.
at::Tensor PartStore::adopt(const at::TensorOptions& master_options, bool broadcast) {
  at::NoGradGuard no_grad;
  const auto& layout = flat_.layout();
  const auto& options = flat_.model_options();
  // Each part's full buffer: its buckets back to back (a split parameter's buckets are consecutive
  // in the layout and in its part's buffer).
  std::vector<int64_t> at_in_part(layout.buckets.size(), 0);
  std::vector<int64_t> part_numel(parts_.size(), 0);
  int64_t max_padded = 0;
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    const auto& bl = layout.buckets[b];
    parts_[bl.part].buckets.push_back(static_cast<int>(b));
    at_in_part[b] = part_numel[bl.part];
    part_numel[bl.part] += bl.padded;
    max_padded = std::max(max_padded, bl.padded);
  }
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    parts_[layout.buckets[layout.slots[i].bucket].part].params.push_back(i);
  }
  full_.resize(layout.buckets.size());
  std::vector<at::Tensor> views(params_.size());
  // Views are checked against the storage's size, not its bytes: a storage with its size and no
  // bytes (released) gives the views without allocating. A persistent part gets bytes for good.
  for (size_t p = 0; p < parts_.size(); ++p) {
    auto& part = parts_[p];
    part.full = at::empty({0}, options);
    part.full.storage().unsafeGetStorageImpl()->set_nbytes(
        static_cast<size_t>(part_numel[p]) * part.full.element_size());
    part.full.set_(part.full.storage(), 0, {part_numel[p]}, {1});
    for (int b : part.buckets) {
      full_[b] = part.full.narrow(0, at_in_part[b], layout.buckets[b].padded);
    }
    for (int i : part.params) {
      const auto& slot = layout.slots[i];
      views[i] = part.full.narrow(0, at_in_part[slot.bucket] + slot.offset, slot.numel)
                     .view(params_[i].sizes());
    }
    part.full.storage().unsafeGetStorageImpl()->reset();
    if (part.persistent) allocate_full(part);
  }
  // This rank's slice of each bucket: packed in shard_, or in a persistent part's full buffer.
  int64_t packed_numel = 0;
  std::vector<int64_t> packed_at(layout.buckets.size(), -1);
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    if (parts_[layout.buckets[b].part].persistent) continue;
    packed_at[b] = packed_numel;
    packed_numel += layout.buckets[b].shard;
  }
  shard_ = at::empty({packed_numel}, options);
  owned_.resize(layout.buckets.size());
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    const auto& bl = layout.buckets[b];
    owned_[b] = packed_at[b] >= 0 ? shard_.narrow(0, packed_at[b], bl.shard)
                                  : full_[b].narrow(0, rank_ * bl.shard, bl.shard);
  }
  // This rank's owned slice of the initial values (rank 0's, broadcast one bucket at a time), in
  // master precision; straight into the model's storage when that is the master (`initial` empty).
  std::vector<std::vector<int>> done_after(layout.buckets.size());
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    done_after[(layout.pieces_end(i) - 1)->bucket].push_back(i);
  }
  const bool from_rank0 = broadcast && comm_->size() > 1;
  const bool same_storage = !plan_.separate_master() &&
                            master_options.dtype() == options.dtype() &&
                            master_options.device() == options.device();
  at::Tensor bucket_values;
  if (from_rank0) bucket_values = at::empty({max_padded}, master_options);
  at::Tensor initial;
  if (!same_storage) initial = at::empty({layout.shard_numel}, master_options);
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    const auto& bl = layout.buckets[b];
    at::Tensor owned = same_storage ? owned_[b] : initial.narrow(0, bl.shard_offset, bl.shard);
    const ShardRange mine = bl.owned(rank_);
    if (from_rank0) {
      at::Tensor full = bucket_values.narrow(0, 0, bl.padded);
      if (rank_ == 0) {
        full.zero_();
        for (int k : bl.pieces) {
          const auto& p = layout.pieces[k];
          full.narrow(0, p.offset, p.numel)
              .copy_(params_[p.param].reshape(-1).narrow(0, p.param_offset, p.numel));
        }
      }
      comm_->broadcast(full, 0, true)->wait(timeout_);
      owned.copy_(full.narrow(0, mine.begin, bl.shard));
    } else {
      owned.zero_();
      for (int k : bl.pieces) {
        const auto& p = layout.pieces[k];
        const ShardRange r = intersect({p.offset, p.offset + p.numel}, mine);
        if (r.empty()) continue;
        owned.narrow(0, r.begin - mine.begin, r.size())
            .copy_(params_[p.param].reshape(-1).narrow(0, p.param_offset + r.begin - p.offset,
                                                        r.size()));
      }
    }
    if (!same_storage) owned_[b].copy_(owned);
    // Same TensorImpl (autograd identity), no storage until gathered (persistent: for good).
    for (int i : done_after[b]) {
      params_[i].set_data(views[i]);
      const int part = layout.buckets[layout.slots[i].bucket].part;
      remember_parameter(params_[i], names_[i], part_labels_[part]);
      if (!parts_[part].persistent) guard_released(params_[i]);  // automatic: for good
    }
  }
  // Automatic units: operations on the parameters find the scheduler through their storage
  // (Note [Part registration] in release_guard.cpp).
  for (int part = 0; part <= root_part_; ++part) {
    if (parts_[part].persistent) {
      gather_in_place(part);
    } else if (automatic_ != nullptr && !parts_[part].params.empty()) {
      registrations_.push_back(
          std::make_unique<PartRegistration>(parts_[part].full, automatic_, part));
    }
  }
  comm_elements_ = 0;  // construction's collectives are no step's
  // The parameters in no unit stay gathered for the first forward, until the first step.
  gather_root();
  return initial;
}

// Any part still gathered holds stale values now; persistent parts are all-gathered in place.
void PartStore::after_update() {
  for (int part = 0; part <= root_part_; ++part) {
    if (parts_[part].persistent) {
      gather_in_place(part);
    } else {
      release(part);
    }
  }
}

void PartStore::gather_root() {
  if (parts_[root_part_].state != PartState::Released || parts_[root_part_].buckets.empty()) return;
  gather_part(root_part_);
}

void PartStore::gather_full() {
  for (int part = 0; part <= root_part_; ++part) prefetch_part(part);
  for (int part = 0; part <= root_part_; ++part) gather_part(part);
}

void PartStore::prefetch_part(int part) {
  if (parts_[part].state == PartState::Released) launch_gather(part);
}

void PartStore::gather_for_backward(int part) {
  gather_part(part);
  if (parts_[part].state == PartState::Gathered) transition(part, PartState::NeededInBackward);
}

void PartStore::transition(int part, PartState to) {
  const PartState from = parts_[part].state;
  const bool legal =
      (from == PartState::Released && to == PartState::Gathering) ||
      (from == PartState::Gathering && to == PartState::Gathered) ||
      (from == PartState::Gathered && to == PartState::NeededInBackward && part != root_part_) ||
      (from == PartState::Gathered && to == PartState::Released) ||
      (from == PartState::NeededInBackward && to == PartState::Released);
  SHARDOPT_INTERNAL_ASSERT(legal, "stage-3 part {} ({}) cannot go from {} to {}", part,
                           part_labels_[part], part_state_name(from), part_state_name(to));
  parts_[part].state = to;
}

void PartStore::allocate_full(Part& p) {
  MemoryScope scope(p.memory_tag);
  auto* storage = p.full.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == 0 && p.full.numel() > 0) {
    const size_t nbytes = static_cast<size_t>(p.full.numel()) * p.full.element_size();
    auto* allocator = storage->allocator() ? storage->allocator()  // CUDA: torch's caching one
                                           : c10::GetAllocator(p.full.device().type());
    storage->set_data_ptr_noswap(allocator->allocate(nbytes));
    storage->set_nbytes(nbytes);
  }
}

// Released -> Gathering: allocates the part's full buffer and starts all-gathering into it.
void PartStore::launch_gather(int part) {
  transition(part, PartState::Gathering);
  auto& p = parts_[part];
  allocate_full(p);
  if (automatic_ == nullptr) {
    for (int i : p.params) unguard(params_[i]);
  }
  p.works = all_gather_buckets(p);
}

std::vector<WorkPtr> PartStore::all_gather_buckets(const Part& p) {
  std::vector<WorkPtr> works;
  for (int b : p.buckets) {
    works.push_back(comm_->all_gather(owned_[b], full_[b], true));
    comm_elements_ += flat_.layout().buckets[b].padded;
  }
  return works;
}

// A persistent part: Gathered for good; the owned slices are views of full_, so the all-gather
// runs in place. The first call (adopt) moves it out of Released.
void PartStore::gather_in_place(int part) {
  auto& p = parts_[part];
  if (p.state == PartState::Released) transition(part, PartState::Gathering);
  if (p.state == PartState::Gathering) transition(part, PartState::Gathered);
  for (auto& w : all_gather_buckets(p)) w->wait(timeout_);
}

// Any state -> Gathered or NeededInBackward: launches the gather if released, waits if in flight.
void PartStore::gather_part(int part) {
  auto& p = parts_[part];
  if (p.state == PartState::Released) launch_gather(part);
  if (p.state != PartState::Gathering) return;
  for (auto& w : p.works) w->wait(timeout_);
  p.works.clear();
  transition(part, PartState::Gathered);
}

// Frees the part's full storage (the parameters keep their shape, not their bytes).
void PartStore::release(int part) {
  auto& p = parts_[part];
  if (p.state == PartState::Released || p.persistent) return;  // persistent: for good
  gather_part(part);  // never free under a collective
  if (p.full.defined()) p.full.storage().unsafeGetStorageImpl()->reset();
  if (automatic_ == nullptr) {
    for (int i : p.params) guard_released(params_[i]);
  }
  transition(part, PartState::Released);
}

int64_t PartStore::full_bytes(bool persistent) const {
  int64_t bytes = 0;
  for (const auto& part : parts_) {
    if (part.persistent == persistent && part.full.defined()) {
      bytes += static_cast<int64_t>(part.full.storage().nbytes());
    }
  }
  return bytes;
}

}  // namespace shardopt::detail
