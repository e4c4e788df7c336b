// ParameterStore: owns the model's parameter storage (StagePlan::Parameters) and keeps it whole
// where the model reads it.
//   Whole:   one flat buffer, full length, that the parameters are views of; sharded plans
//            all-gather it after each update.
//   PerPart: stage 3 (Note [Stage 3 units] in engine.cpp). This rank's shard of every bucket is
//            the storage; each part also has one full buffer (its buckets back to back, so a
//            parameter split across two of them is still one contiguous view) whose storage
//            exists only while the part is gathered, and the parameters are views into it. Each
//            part moves through one lifecycle (Note [Part lifecycle] in parameter_store.cpp),
//            on request: the store has no policy; a scheduler (part_scheduler.hpp) decides.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/flat_state.hpp"
#include "engine/release_guard.hpp"
#include "shardopt/comm.hpp"

namespace shardopt::detail {

// Where a stage-3 part stands (Note [Part lifecycle] in parameter_store.cpp).
enum class PartState {
  Released,          // no storage; the parameters are guarded
  Gathering,         // storage allocated, all-gathers in flight
  Gathered,          // storage holds the full values
  NeededInBackward,  // gathered for its backward: kept until its gradients are in
};
const char* part_state_name(PartState state);

class ParameterStore {
 public:
  // params[i] is layout slot i, named names[i]. PerPart: parameters are gathered in parts (the
  // buckets' part field), the last the root part (parameters in no unit: gathered from
  // construction or gather_root() until the end of the step); part_labels[p]: how errors name
  // part p's units (Note [Released parameters] in
  // release_guard.cpp: released parameters raise a named error when read). Whole plans pass one
  // part. root_persists: the root part is persistent (Note [Persistent parameters] in
  // parameter_store.cpp): gathered for good, its shard a view into it.
  ParameterStore(const FlatState& flat, std::vector<at::Tensor> params,
                 std::vector<std::string> names, std::vector<std::string> part_labels,
                 CommunicatorPtr comm, Duration timeout, bool root_persists = false);
  // Lets in-flight all-gathers land before the buffers they write go away.
  ~ParameterStore();

  // Takes over the parameters' storage with their initial values (rank 0's on every rank when
  // `broadcast`, as DDP does) and returns those values in `master_options`, the master weights'
  // start (FlatState::init_master): the full flat buffer (Whole), or this rank's shard
  // (PerPart). The parameters become views into the store's storage (same TensorImpl, so
  // autograd identity is kept); construction holds about one copy of the model (Note [One copy
  // at construction] in parameter_store.cpp). PerPart: the parameters start released but the
  // root part, which is gathered.
  at::Tensor adopt(const at::TensorOptions& master_options, bool broadcast);
  // The model's storage of a bucket's updated range (the update's target or its low copy).
  at::Tensor model_slice(int bucket, const UpdatedRange& range) const;
  // This rank's owned slice of a bucket in the model's storage.
  at::Tensor owned_slice(int bucket) const;
  // Whole plans: the full flat buffer.
  const at::Tensor& whole() const { return flat_params_; }

  // After the update: all-gather the updated shards (Whole), or release every part, the root
  // part included, but all-gather a persistent part in place (PerPart).
  void after_update();

  // ---- PerPart: on request of a scheduler (part_scheduler.hpp) -------------------------------
  int root_part() const { return root_part_; }
  int part_count() const { return static_cast<int>(parts_.size()); }
  PartState part_state(int part) const { return parts_[part].state; }
  bool part_gathered(int part) const { return parts_[part].state != PartState::Released; }
  void prefetch_part(int part);          // starts gathering it (no wait)
  void gather_part(int part);            // gathered when it returns
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

  int64_t take_comm_elements();
  int64_t param_bytes() const;       // the model's storage (PerPart: shards + persistent parts)
  int64_t persistent_bytes() const;  // PerPart: the persistent parts' whole buffers
  int64_t gathered_bytes() const;    // PerPart: other parts' full buffers holding storage now

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
  at::Tensor adopt_whole(const at::TensorOptions& master_options, bool broadcast);
  at::Tensor adopt_shards(const at::TensorOptions& master_options, bool broadcast);
  // The one place a part's state changes; asserts the change is legal (Note [Part lifecycle]).
  void transition(int part, PartState to);
  void launch_gather(int part);
  void allocate_full(Part& p);
  // Persistent parts: all-gather each bucket's owned slice in place (after an update or load).
  void gather_in_place(int part);
  void ensure_gathered(int part);

  const FlatState& flat_;
  const StagePlan plan_;
  GatherOnUse* automatic_ = nullptr;
  std::vector<std::unique_ptr<PartRegistration>> registrations_;  // automatic: per part
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<std::string> part_labels_;
  CommunicatorPtr comm_;
  Duration timeout_;
  int rank_ = 0;
  at::Tensor flat_params_;        // Whole: every parameter, full length
  at::Tensor shard_;              // PerPart: this rank's slice of every non-persistent bucket
  std::vector<at::Tensor> owned_; // PerPart: per bucket, this rank's slice (in shard_ or, for a
                                  // persistent part, in its full buffer)
  std::vector<at::Tensor> full_;  // PerPart: per bucket, a view of its part's full buffer
  std::vector<Part> parts_;       // declared units' own parts, shared ones, the root
  int root_part_ = 0;
  int64_t comm_elements_ = 0;
};

}  // namespace shardopt::detail
