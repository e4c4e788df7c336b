// The non-finite check over tensors: the device's kernels where they take the tensor, torch's
// operations otherwise, and the all-reduce that makes every rank answer alike.
#include "engine/finite_check.hpp"

#include <ATen/ATen.h>

#include <cmath>
#include <optional>

#include "engine/fused_kernels.hpp"

namespace shardopt::detail {
namespace {

std::optional<kernels::ValueKind> value_kind(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return kernels::ValueKind::Float32;
    case at::kBFloat16: return kernels::ValueKind::BFloat16;
    case at::kHalf: return kernels::ValueKind::Float16;
    default: return std::nullopt;
  }
}

}  // namespace

bool folds_scale(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.is_contiguous() &&
         fused_kernels_for(t.device().type()) != nullptr;
}

// The kernels' single pass, or torch's operations (also for 16-bit scaling, whose rounding torch's
// mul_ defines).
FiniteScan scan_local(const at::Tensor& t, double scale, bool sum_squares) {
  if (!t.defined() || t.numel() == 0) return {};
  const auto kind = value_kind(t.scalar_type());
  const FusedKernels* kernels = fused_kernels_for(t.device().type());
  const bool fold_scale = kind == kernels::ValueKind::Float32;
  if (scale != 1.0 && !fold_scale) t.mul_(scale);
  if (kernels && kind && t.is_contiguous()) {
    kernels::CheckOptions o;
    o.scale = fold_scale ? static_cast<float>(scale) : 1.0f;
    o.sum_squares = sum_squares;
    return kernels->check_finite({*kind, t.data_ptr(), t.numel()}, o);
  }
  if (scale != 1.0 && fold_scale) t.mul_(scale);
  FiniteScan r;
  r.non_finite = !at::isfinite(t).all().item<bool>();
  if (sum_squares) {
    const double n = t.norm().to(at::kDouble).item<double>();
    r.sum_sq = n * n;
  }
  return r;
}

void add_scan(FiniteScan& total, const FiniteScan& part) {
  total.non_finite = total.non_finite || part.non_finite;
  total.sum_sq += part.sum_sq;
}

FiniteScan agree_on(FiniteScan scan, bool sum_squares, Communicator* agree, Duration timeout) {
  scan.non_finite = scan.non_finite || !std::isfinite(scan.sum_sq);
  if (agree != nullptr && agree->size() > 1 && sum_squares) {
    // The sum of squares (a rank's non-finite value makes it NaN, and so the total).
    at::Tensor sum = at::full({1}, scan.non_finite ? std::nan("") : scan.sum_sq, at::kDouble);
    agree->all_reduce(sum, ReduceOp::Sum, true)->wait(timeout);
    scan.sum_sq = sum.item<double>();
    scan.non_finite = !std::isfinite(scan.sum_sq);
  } else if (agree != nullptr && agree->size() > 1) {
    at::Tensor flag = at::full({1}, scan.non_finite ? 1.0f : 0.0f, at::kFloat);
    agree->all_reduce(flag, ReduceOp::Max, true)->wait(timeout);
    scan.non_finite = flag.item<float>() > 0;
  }
  return scan;
}

}  // namespace shardopt::detail
