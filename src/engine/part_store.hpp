// PartStore: stage 3's parameter storage (Note [Stage 3 units] in engine.cpp): this rank's shard of
// every bucket, and per part one full buffer (its buckets back to back), the parameters' storage,
// holding bytes only while the part is gathered. Parts move through one lifecycle (Note [Part
// lifecycle] in part_store.cpp) on request; a scheduler (part_scheduler.hpp) decides.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/parameter_store.hpp"
#include "engine/release_guard.hpp"

namespace shardopt::detail {

// Where a stage-3 part stands (Note [Part lifecycle] in part_store.cpp).
enum class PartState {
  Released,          // no storage; the parameters are guarded
  Gathering,         // storage allocated, all-gathers in flight
  Gathered,          // storage holds the full values
  NeededInBackward,  // gathered for its backward: kept until its gradients are in
};
const char* part_state_name(PartState state);

class PartStore final : public ParameterStore {
 public:
  // params[i] is layout slot i, named names[i]; parts are the buckets' part field, the last the
  // root part (parameters in no unit). part_labels[p]: how errors name part p's units.
  // root_persists: the root part is persistent (Note [Persistent parameters] in part_store.cpp).
  PartStore(const FlatState& flat, std::vector<at::Tensor> params, std::vector<std::string> names,
            std::vector<std::string> part_labels, CommunicatorPtr comm, Duration timeout,
            bool root_persists);
  // Lets in-flight all-gathers land before the buffers they write go away.
  ~PartStore() override;

  // The parameters start released but the root part; returns this rank's shard of the initial
  // values in master precision (empty when the shard itself is the master).
  at::Tensor adopt(const at::TensorOptions& master_options, bool broadcast) override;
  at::Tensor model_slice(int bucket, const UpdatedRange& range) const override {
    return owned_[bucket].narrow(0, 0, range.length);
  }
  at::Tensor owned_slice(int bucket) const override { return owned_[bucket]; }
  // Every part is released but a persistent one, which is all-gathered in place.
  void after_update() override;
  int64_t param_bytes() const override {  // shards + persistent parts
    return static_cast<int64_t>(shard_.nbytes()) + persistent_bytes();
  }
  // The persistent parts' whole buffers; the other parts' full buffers holding storage now.
  int64_t persistent_bytes() const override { return full_bytes(true); }
  int64_t gathered_bytes() const override { return full_bytes(false); }

  // On request of a scheduler (part_scheduler.hpp).
  int root_part() const { return root_part_; }
  int part_count() const { return static_cast<int>(parts_.size()); }
  PartState part_state(int part) const { return parts_[part].state; }
  void prefetch_part(int part);          // starts gathering it (no wait)
  void gather_part(int part);            // gathered when it returns (waits for a prefetch)
  void gather_for_backward(int part);    // gathered, and NeededInBackward until released
  // Frees part `part` if it holds storage (a persistent part: never).
  void release(int part);
  // Gathers the root part (parameters in no unit) if it is not.
  void gather_root();
  // Gathers every part (to read or save the whole model outside a pass).
  void gather_full();
  // Automatic units, before adopt(): the parameters keep the release guard's key for good and
  // operations on them call `owner` (release_guard.hpp), instead of Units::run entering units.
  void set_automatic(GatherOnUse* owner) { automatic_ = owner; }

 private:
  struct Part {
    std::vector<int> buckets;
    at::Tensor full;             // the buckets' full buffers back to back
    std::vector<int> params;     // layout slots of its parameters (guarded while released)
    PartState state = PartState::Released;
    std::vector<WorkPtr> works;  // all-gathers in flight (Gathering only)
    bool persistent = false;     // gathered for good, holding this rank's shard
    int memory_tag = 0;          // its full buffer's MemoryScope tag (Note [Peak attribution])
  };
  // The one place a part's state changes; asserts the change is legal (Note [Part lifecycle]).
  void transition(int part, PartState to);
  void launch_gather(int part);
  std::vector<WorkPtr> all_gather_buckets(const Part& p);  // each bucket: owned slice -> full
  void allocate_full(Part& p);
  // Persistent parts: all-gather each bucket's owned slice in place (after an update or load).
  void gather_in_place(int part);
  int64_t full_bytes(bool persistent) const;

  GatherOnUse* automatic_ = nullptr;
  std::vector<std::unique_ptr<PartRegistration>> registrations_;  // automatic: per part
  std::vector<std::string> names_;
  std::vector<std::string> part_labels_;
  at::Tensor shard_;              // this rank's slice of every non-persistent bucket
  std::vector<at::Tensor> owned_; // per bucket, this rank's slice (in shard_ or, for a
                                  // persistent part, in its full buffer)
  std::vector<at::Tensor> full_;  // per bucket, a view of its part's full buffer
  std::vector<Part> parts_;       // declared units' own parts, shared ones, the root
  int root_part_ = 0;
};

}  // namespace shardopt::detail
