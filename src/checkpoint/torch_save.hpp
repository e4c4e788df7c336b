// Writes the zip file format of Python's torch.save (protocol-2 pickle + one record per tensor)
// for the values a state dict holds, using only globals torch.load(weights_only=True) accepts.
#pragma once

#include <ATen/core/ivalue.h>

#include <vector>

namespace shardopt::detail {

// Serialises `value` as torch.save(value, f) would: dicts with string keys, strings, ints,
// floats, bools, None, lists and CPU/GPU tensors of the usual dtypes (tensors are written as
// contiguous CPU copies, so views and non-contiguous tensors are fine). The bytes load with
// torch.load(path) on torch 1.13 and 2.x, with weights_only=True too, and with
// torch::jit::pickle_load in C++. Throws shardopt::Error (InvalidArgument) naming what it cannot
// represent.
std::vector<char> torch_save_bytes(const c10::IValue& value);

}  // namespace shardopt::detail
