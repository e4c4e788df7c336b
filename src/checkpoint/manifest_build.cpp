// Building a checkpoint's manifest at save time (read and checked by manifest.cpp), and the split
// records of a rank's parameter copies that it lists.
#include <fmt/format.h>

#include <string>
#include <utility>
#include <vector>

#include "checkpoint/files.hpp"
#include "checkpoint/format.hpp"
#include "checkpoint/manifest.hpp"
#include "shardopt/checkpoint.hpp"
#include "shardopt/error.hpp"
#include "shardopt/grid_checkpoint.hpp"
#include "shardopt/tensor_parallel.hpp"
#include "shardopt/version.hpp"

namespace shardopt::detail {

std::vector<int64_t> split_of_param(const ShardAccess& a, int index) {
  const auto split = tp::split_of(a.param_tensor(index));
  if (!split) return {};
  const int64_t local = a.param_shape(index)[split->dim];
  if (local == split->full_size && local == split->padded_size) return {};
  return {split->dim, split->full_size, split->padded_size};
}

TensorPlacement placement_of_param(const ShardAccess& a, int index) {
  TensorPlacement p;
  p.shape = a.param_shape(index);
  const auto record = tp::record_of(a.param_tensor(index));
  if (record && record->split && record->group) {
    p.dim = record->split->dim;
    p.full = record->split->full_size;
    p.padded = record->split->padded_size;
    p.rank = record->group->rank();
    p.ranks = record->group->size();
  }
  return p;
}

std::pair<int, int> split_place_of_param(const ShardAccess& a, int index) {
  const auto record = tp::record_of(a.param_tensor(index));
  if (!record || !record->split || record->group == nullptr) return {0, 1};
  return {record->group->rank(), record->group->size()};
}

json build_manifest(ShardAccess& a, const std::vector<std::string>& names, const json& trainer,
                    const std::vector<json>& files, const json& module) {
  const auto& layout = a.layout();
  const int world = a.comm()->size();
  json m;
  m["format"] = kFormat;
  m["format_version"] = kCheckpointFormatVersion;
  m["shardopt_version"] = version();
  m["world_size"] = world;
  m["stage"] = a.zero_options().stage;
  m["precision"] = to_string(a.zero_options().precision);
  m["dtype"] = dtype_name(a.master_dtype());
  m["step"] = a.step_count();
  json groups = json::array();
  for (int g = 0; g < a.group_count(); ++g) groups.push_back(rule_to_json(a.group_rule(g)));
  m["optimizer"] = {
      {"rule", rule_name(a.group_rule(0))}, {"state", names}, {"param_groups", groups}};
  m["loss_scaler"] = nullptr;  // fp16 stores its dynamic loss scaler here
  if (const auto scaler = a.loss_scaler_state()) {
    m["loss_scaler"] = {{"scale", scaler->scale},
                        {"good_steps", scaler->good_steps},
                        {"hysteresis_left", scaler->hysteresis_left},
                        {"overflows", scaler->overflows}};
  }
  json buckets = json::array();
  for (const auto& b : layout.buckets) {
    buckets.push_back({{"group", b.group},
                       {"flat_offset", b.flat_offset},
                       {"numel", b.numel},
                       {"padded", b.padded},
                       {"shard", b.shard},
                       {"shard_offset", b.shard_offset}});
  }
  m["layout"] = {{"numel", layout.numel},
                 {"padded_numel", layout.padded_numel},
                 {"shard_numel", layout.shard_numel},
                 {"buckets", buckets}};
  // Listed in the model's named_parameters() order, so a consolidated state dict reads like
  // model.state_dict(); pieces do not depend on the order.
  std::vector<int> order(layout.slots.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int x, int y) { return a.param_order(x) < a.param_order(y); });
  // Every rank's element sums (Note [Element checksums]), added up per parameter; the file
  // entries keep none.
  std::vector<json> file_entries = files;
  std::map<std::string, std::vector<uint64_t>> sums;
  for (json& f : file_entries) {
    const auto it = f.find("element_sums");
    if (it == f.end()) continue;
    for (const auto& [name, list] : it->items()) {
      auto& total = sums[name];
      total.resize(list.size(), 0);
      for (size_t k = 0; k < list.size(); ++k) {
        total[k] += std::stoull(list[k].get<std::string>(), nullptr, 16);
      }
    }
    f.erase(it);
  }
  json params = json::array();
  for (const int i : order) {
    const auto& slot = layout.slots[i];
    json pieces = json::array();
    for (const auto& p : detail::saved_pieces(layout, i, world)) {
      pieces.push_back({p.rank, p.shard_begin, p.param_begin, p.numel});
    }
    const auto split = split_of_param(a, i);
    json split_json = nullptr;
    if (!split.empty()) {
      const auto [tp_rank, tp_size] = split_place_of_param(a, i);
      split_json = {{"dim", split[0]},       {"full_size", split[1]}, {"padded_size", split[2]},
                    {"tp_rank", tp_rank},    {"tp_size", tp_size}};
    }
    // The unsplit tensor's shape (Note [Placement in the manifest]): the split dimension at its
    // full size.
    std::vector<int64_t> global_shape = a.param_shape(i);
    if (!split.empty()) global_shape[split[0]] = split[1];
    params.push_back({{"name", a.param_name(i)},
                      {"shape", a.param_shape(i)},
                      {"global_shape", global_shape},
                      {"split", split_json},
                      {"dtype", dtype_name(a.master_dtype())},
                      {"numel", slot.numel},
                      {"group", layout.buckets[slot.bucket].group},
                      {"bucket", slot.bucket},
                      {"offset", slot.offset},
                      {"flat_offset", layout.buckets[slot.bucket].flat_offset + slot.offset},
                      {"pieces", pieces}});
    if (const auto it = sums.find(a.param_name(i)); it != sums.end()) {
      json hex = json::array();
      for (const uint64_t v : it->second) hex.push_back(fmt::format("{:016x}", v));
      params.back()["sums"] = hex;
    }
  }
  m["parameters"] = params;
  m["files"] = file_entries;
  m["trainer"] = trainer;
  if (!module.is_null()) m["module"] = module;
  m[kManifestCrc] = crc_text(manifest_crc(m));
  return m;
}

}  // namespace shardopt::detail
