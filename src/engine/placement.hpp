// The tensor options of each kind of buffer the engine allocates, from the plan's Placement (Note
// [Placement] in shardopt/detail/plan.hpp) and the parameters as given.
#pragma once

#include <c10/core/TensorOptions.h>

#include "shardopt/detail/plan.hpp"

namespace shardopt::detail {

inline at::ScalarType scalar_type(Dtype dtype, at::ScalarType given) {
  switch (dtype) {
    case Dtype::F32: return at::kFloat;
    case Dtype::F16: return at::kHalf;
    case Dtype::BF16: return at::kBFloat16;
    case Dtype::AsGiven: break;
  }
  return given;
}

// The dtype the model computes in under `precision` (fp32: float).
inline at::ScalarType compute_dtype(Precision precision) {
  return scalar_type(dtype_of(precision), at::kFloat);
}

struct BufferOptions {
  at::TensorOptions model;   // the model's parameters (and InPlace gradients)
  at::TensorOptions master;  // master weights, optimizer state, reduced gradients
  at::TensorOptions reduce;  // bucket buffers: the dtype gradients travel in
  at::TensorOptions initial; // the initial values: master dtype, on the parameters' device
};

// `given`: the options of the first trainable parameter.
inline BufferOptions buffer_options(const Placement& p, const at::TensorOptions& given) {
  const auto base = given.requires_grad(false);
  const auto dtype = given.dtype().toScalarType();
  BufferOptions o;
  o.model = base.dtype(scalar_type(p.model, dtype));
  o.initial = base.dtype(scalar_type(p.master, dtype));
  o.master = p.master_on_host ? o.initial.device(at::kCPU).pinned_memory(p.pinned) : o.initial;
  o.reduce = o.model.dtype(scalar_type(p.reduce, dtype));
  return o;
}

}  // namespace shardopt::detail
