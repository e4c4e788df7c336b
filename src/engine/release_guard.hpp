// Release guard: a stage-3 parameter whose unit is released raises a clear error, naming it, when
// any ATen operation reads it (sum, clone, print, a forward outside Units::run), instead of
// reading storage that was freed. See Note [Released parameters] in release_guard.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

namespace shardopt::detail {

// Messages name `param` (by TensorImpl) `name`, in the part `part_label` names, until
// forget_parameter(); a parameter still guarded then keeps raising, without its name.
void remember_parameter(const at::Tensor& param, std::string name, std::string part_label);
void forget_parameter(const at::Tensor& param);
// Released: every ATen operation on `param` throws Error{InvalidArgument} naming it. Cheap: one
// bit in the tensor's dispatch key set. Not thread-safe against concurrent ops on `param`.
void guard_released(const at::Tensor& param);
// Gathered: operations reach the real kernels again.
void unguard(const at::Tensor& param);

// Automatic stage-3 units (Note [Automatic units] in src/engine/auto_gather.cpp): an operation on
// a tensor whose storage the part store registered first calls owner.use(parts), which gathers
// them; a tensor still without bytes afterwards raises the named error above.
class GatherOnUse {
 public:
  virtual ~GatherOnUse() = default;
  // `parts`: the distinct parts of this owner one operation reads, all needed at once.
  virtual void use(const std::vector<int>& parts) = 0;
};
// False when another library holds the dispatch key: released reads then go unguarded, and
// automatic units cannot work (stage 3 then keeps every parameter gathered through the step).
bool release_guard_available();

// The part store's registration of one part (Note [Part registration] in release_guard.cpp):
// while it lives, the storage of `storage_holder` allocates through a handle naming (owner, part).
class PartRegistration {
 public:
  PartRegistration(const at::Tensor& storage_holder, GatherOnUse* owner, int part);
  ~PartRegistration();
  PartRegistration(const PartRegistration&) = delete;
  PartRegistration& operator=(const PartRegistration&) = delete;
  struct Handle;  // the storage's allocator while registered (release_guard.cpp)

 private:
  std::unique_ptr<Handle> handle_;
};

}  // namespace shardopt::detail
