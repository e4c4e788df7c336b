// The one name table of Precision ("fp32", "fp16", "bf16") and Offload ("none", "cpu"): options
// (to_string, parse_precision), the estimator, the CLIs and Python convert through it, each adding
// its own error. Torch-free and header-only (the shardopt-estimate tool has no library).
#pragma once

#include <optional>
#include <string_view>

#include "shardopt/precision.hpp"
#include "shardopt/sharding.hpp"

namespace shardopt::detail {

constexpr const char* precision_name(Precision precision) {
  switch (precision) {
    case Precision::FP32: return "fp32";
    case Precision::FP16: return "fp16";
    case Precision::BF16: return "bf16";
  }
  return "?";
}
inline std::optional<Precision> precision_named(std::string_view name) {
  for (Precision p : {Precision::FP32, Precision::FP16, Precision::BF16}) {
    if (name == precision_name(p)) return p;
  }
  return std::nullopt;
}

constexpr const char* offload_name(Offload offload) {
  return offload == Offload::CPU ? "cpu" : "none";
}
inline std::optional<Offload> offload_named(std::string_view name) {
  for (Offload o : {Offload::None, Offload::CPU}) {
    if (name == offload_name(o)) return o;
  }
  return std::nullopt;
}

}  // namespace shardopt::detail
