// A snapshot's record: its fingerprint, the saving layout it carries, and reading it back verified
// (snapshot_record.hpp; Note [Snapshots in memory] in shardopt/snapshot.hpp).
#include "checkpoint/snapshot_record.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cstring>
#include <exception>

#include "shardopt/error.hpp"

namespace shardopt::detail {

json snapshot_fingerprint(ShardAccess& a, int world, int rank) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  auto mix = [&h](const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const uint8_t*>(p)[i]) * 1099511628211ull;
  };
  for (size_t i = 0; i < a.layout().slots.size(); ++i) {
    const std::string& name = a.param_name(static_cast<int>(i));
    mix(name.data(), name.size() + 1);
    for (int64_t d : a.param_shape(static_cast<int>(i))) mix(&d, sizeof d);
  }
  return {
      {"world", world},
      {"rank", rank},
      {"stage", static_cast<int>(a.zero_options().stage)},
      {"dtype", dtype_name(a.master_dtype())},
      {"shard_numel", a.layout().shard_numel},
      {"buckets", a.layout().buckets.size()},
      {"state_buffers", a.state_buffer_count()},
      {"groups", a.group_count()},
      {"shard_ranks", a.comm()->size()},
      {"replica", a.replica()},
      {"parameters", fmt::format("{} of names and shapes {:016x}", a.layout().slots.size(), h)}};
}

bool fingerprint_key_follows_world(const std::string& key) {
  return key == "world" || key == "rank" || key == "shard_numel" || key == "buckets" ||
         key == "shard_ranks";
}

int64_t snapshot_payload_bytes(ShardAccess& a) {
  return (1 + a.state_buffer_count()) * a.layout().shard_numel *
         static_cast<int64_t>(c10::elementSize(a.master_dtype()));
}

json snapshot_layout(const FlatLayout& l, int shard_rank) {
  json buckets = json::array(), pieces = json::array();
  for (const BucketLayout& b : l.buckets) buckets.push_back({b.shard, b.shard_offset});
  for (const ParamPiece& p : l.pieces) {
    pieces.push_back({p.param, p.bucket, p.offset, p.param_offset, p.numel});
  }
  return {{"shard_rank", shard_rank},
          {"shard_numel", l.shard_numel},
          {"buckets", buckets},
          {"pieces", pieces}};
}

json snapshot_layout(ShardAccess& a) { return snapshot_layout(a.layout(), a.comm()->rank()); }

FlatLayout layout_from_snapshot(const json& j, int params, const std::string& where) {
  FlatLayout l;
  try {
    l.shard_numel = j.at("shard_numel").get<int64_t>();
    for (const auto& b : j.at("buckets")) {
      BucketLayout bl;
      bl.shard = b.at(0).get<int64_t>();
      bl.shard_offset = b.at(1).get<int64_t>();
      SHARDOPT_CHECK(
          bl.shard >= 0 && bl.shard_offset >= 0 && bl.shard_offset <= l.shard_numel - bl.shard,
          Checkpoint, "snapshot: {}: bucket {} lies outside the shard of {} elements", where,
          l.buckets.size(), l.shard_numel);
      l.buckets.push_back(bl);
    }
    l.slots.resize(static_cast<size_t>(params));
    for (auto& s : l.slots) s.piece_count = 0;
    for (const auto& p : j.at("pieces")) {
      ParamPiece pc;
      pc.param = p.at(0).get<int>();
      pc.bucket = p.at(1).get<int>();
      pc.offset = p.at(2).get<int64_t>();
      pc.param_offset = p.at(3).get<int64_t>();
      pc.numel = p.at(4).get<int64_t>();
      const bool in_range = pc.param >= 0 && pc.param < params && pc.bucket >= 0 &&
                            pc.bucket < static_cast<int>(l.buckets.size()) && pc.offset >= 0 &&
                            pc.param_offset >= 0 && pc.numel >= 0;
      SHARDOPT_CHECK(in_range, Checkpoint, "snapshot: {}: piece {} names no parameter or bucket",
                     where, l.pieces.size());
      // Pieces are grouped by parameter, in parameter order.
      ParamSlot& slot = l.slots[static_cast<size_t>(pc.param)];
      if (slot.piece_count == 0) {
        SHARDOPT_CHECK(l.pieces.empty() || l.pieces.back().param < pc.param, Checkpoint,
                       "snapshot: {}: the pieces of parameter {} are not together", where,
                       pc.param);
        slot.first_piece = static_cast<int>(l.pieces.size());
        slot.bucket = pc.bucket;
        slot.offset = pc.offset;
      } else {
        SHARDOPT_CHECK(l.pieces.back().param == pc.param, Checkpoint,
                       "snapshot: {}: the pieces of parameter {} are not together", where,
                       pc.param);
      }
      ++slot.piece_count;
      slot.numel += pc.numel;
      l.pieces.push_back(pc);
    }
  } catch (const json::exception& e) {
    SHARDOPT_FAIL(Checkpoint, "snapshot: {}: malformed layout: {}", where, e.what());
  }
  return l;
}

SnapshotRecord open_snapshot_record(SlotFile& slot, int64_t number) {
  const std::string where = slot.path();
  SnapshotRecord r;
  const auto p = slot.read_prefix();
  SHARDOPT_CHECK(p && p->number == number, Checkpoint,
                 "snapshot: {} does not hold snapshot {} (it was overwritten or torn)", where,
                 number);
  r.prefix = *p;
  slot.map(p->payload_bytes);
  SHARDOPT_CHECK(crc32c_quarters(slot.payload(), p->payload_bytes) == p->payload_crc, Checkpoint,
                 "snapshot: {}: the state's CRC-32C does not match (corrupt)", where);
  r.tail = slot.read_tail(*p);
  SHARDOPT_CHECK(crc32c(r.tail.data(), p->tail_bytes) == p->tail_crc, Checkpoint,
                 "snapshot: {}: the record's CRC-32C does not match (corrupt)", where);
  try {
    r.j = json::parse(r.tail.substr(0, static_cast<size_t>(p->json_bytes)));
  } catch (const std::exception& e) {
    SHARDOPT_FAIL(Checkpoint, "snapshot: {}: unreadable record: {}", where, e.what());
  }
  SHARDOPT_CHECK(r.j.value("format", "") == kSnapshotFormat && r.j.value("version", 0) == 1,
                 Checkpoint, "snapshot: {}: not a version-1 {} record", where, kSnapshotFormat);
  return r;
}

StagedSnapshot parse_snapshot_record(ShardAccess& a, const SnapshotRecord& r,
                                     const std::string& where, bool with_tensors) {
  const json& record = r.j;
  StagedSnapshot out;
  try {
    out.steps = checked_step_count(record.at("steps").get<int64_t>(), where);
    for (const auto& rule : record.at("rules")) out.rules.push_back(rule_from_json(rule));
    SHARDOPT_CHECK(static_cast<int>(out.rules.size()) == a.group_count(), Mismatch,
                   "snapshot: {} has {} parameter groups, this optimizer {}", where,
                   out.rules.size(), a.group_count());
    if (const auto& ls = record.at("loss_scaler"); !ls.is_null()) {
      out.scaler =
          LossScaler::State{ls.at("scale").get<double>(), ls.at("good_steps").get<int64_t>(),
                            ls.at("hysteresis_left").get<int>(), ls.at("overflows").get<int64_t>()};
    }
    out.trainer.json = record.at("trainer_json").get<std::string>();
    if (!with_tensors) return out;
    const SlotPrefix& p = r.prefix;
    const int64_t data_bytes = p.tail_bytes - p.json_bytes;
    for (const auto& t : record.at("tensors")) {
      const std::string key = t.at("key").get<std::string>();
      const auto shape = t.at("shape").get<std::vector<int64_t>>();
      const auto dtype = dtype_from_name(t.at("dtype").get<std::string>(), where);
      const int64_t offset = t.at("offset").get<int64_t>(), bytes = t.at("bytes").get<int64_t>();
      const int64_t numel = checked_numel(shape, where + " tensor " + key);
      SHARDOPT_CHECK(
          offset >= 0 && bytes == numel * static_cast<int64_t>(c10::elementSize(dtype)) &&
              bytes <= data_bytes - offset,
          Checkpoint, "snapshot: {}: trainer tensor {} lies outside the record", where, key);
      at::Tensor value = at::empty(shape, at::TensorOptions().dtype(dtype));
      std::memcpy(value.data_ptr(), r.tail.data() + p.json_bytes + offset,
                  static_cast<size_t>(bytes));
      out.trainer.tensors[key] = value;
    }
  } catch (const json::exception& e) {
    SHARDOPT_FAIL(Checkpoint, "snapshot: {}: malformed record: {}", where, e.what());
  }
  return out;
}

}  // namespace shardopt::detail
