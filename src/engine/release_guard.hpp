// Release guard: a stage-3 parameter whose unit is released raises a clear error, naming it, when
// any ATen operation reads it (sum, clone, print, a forward outside Units::run), instead of
// reading storage that was freed. See Note [Released parameters] in release_guard.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace shardopt::detail {

// `param` (a model parameter, by TensorImpl) is known as `name`, of unit `unit`, in messages until
// forget_parameter(); a parameter still guarded then keeps raising, without its name.
void remember_parameter(const at::Tensor& param, std::string name, std::string unit);
void forget_parameter(const at::Tensor& param);
// Released: every ATen operation on `param` throws Error{InvalidArgument} naming it. Cheap: one
// bit in the tensor's dispatch key set. Not thread-safe against concurrent ops on `param`.
void guard_released(const at::Tensor& param);
// Gathered: operations reach the real kernels again.
void unguard(const at::Tensor& param);

}  // namespace shardopt::detail
