// Collective save and load of sharded checkpoints: each runs as agreed steps (checks, shard files,
// manifest and publish; or checks and staging, then commit), so that either every rank succeeds or
// none changes anything (Notes [Atomic checkpoints], [Agreement before state changes]).
#include "shardopt/checkpoint.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: not reached through ATen.h on torch 2.6
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>

#include "checkpoint/files.hpp"
#include "checkpoint/element_sums.hpp"
#include "kernels/finite.hpp"
#include "checkpoint/format.hpp"
#include "checkpoint/manifest.hpp"
#include "checkpoint/saving.hpp"
#include "checkpoint/shard_image.hpp"
#include "checkpoint/staging.hpp"
#include "comm/agreement.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/detail/shard_plan.hpp"
#include "shardopt/error.hpp"

namespace shardopt {

namespace fs = std::filesystem;
// The checkpoint internals (src/checkpoint/*.hpp) are all in detail.
using namespace detail;  // NOLINT(google-build-using-namespace)

namespace {

// Never publish NaN/Inf over the last good checkpoint: every slice a rank writes is checked first
// (one extra read of the shard; saves are rare; an asynchronous save's copy checks it in its
// pass, see Note [Shard images]), and agree() makes every rank fail together, leaving the
// previous checkpoint in place. The error names the first parameter affected.
// Whether every element of `slice` is finite: the fused kernel where it takes the dtype (one read,
// no allocation: Note [Exact non-finite check]), else ATen.
bool all_finite(const at::Tensor& slice) {
  const auto dtype = slice.scalar_type();
  if (slice.device().is_cpu() && slice.is_contiguous() &&
      (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf)) {
    kernels::CheckSegment segment;
    segment.kind = dtype == at::kFloat      ? kernels::ValueKind::Float32
                   : dtype == at::kBFloat16 ? kernels::ValueKind::BFloat16
                                            : kernels::ValueKind::Float16;
    segment.data = slice.data_ptr();
    segment.numel = slice.numel();
    return !kernels::check_finite(segment).non_finite;
  }
  return at::isfinite(slice).all().item<bool>();
}

void check_finite(ShardAccess& a, int bucket, const at::Tensor& slice, const std::string& section,
                  bool elementwise = true) {
  if (!at::isFloatingType(slice.scalar_type()) || all_finite(slice)) return;
  const auto& layout = a.layout();
  const auto& bl = layout.buckets[bucket];
  const int rank = a.comm()->rank();
  SHARDOPT_CHECK(elementwise, NonFinite,
                 "checkpoint: the {} of bucket {} holds NaN/Inf on rank {}; refusing to save "
                 "non-finite values",
                 section, bucket, rank);
  const int64_t at_bucket =
      bl.owned(rank).begin + at::logical_not(at::isfinite(slice)).nonzero()[0][0].item<int64_t>();
  std::string name = "(padding)";
  for (int k : bl.pieces) {
    const ParamPiece& p = layout.pieces[k];
    if (at_bucket >= p.offset && at_bucket < p.offset + p.numel) name = a.param_name(p.param);
  }
  SHARDOPT_FAIL(NonFinite,
                "checkpoint: the {} of parameter '{}' holds NaN/Inf on rank {}; refusing to save "
                "non-finite values",
                section, name, rank);
}

// This rank's part of parameter i's element sums (Note [Element checksums]): the values and each
// state section, read from the owned slices (`slices_of(bucket)`: its param and state slices),
// except the sections an asynchronous save's image summed in its copy (Note [Shard images]).
std::vector<uint64_t> element_sums_of(
    ShardAccess& a, int i, const StateSections& state, size_t sections,
    const std::function<const std::vector<at::Tensor>&(int)>& slices_of, const ShardImage* image) {
  const auto& layout = a.layout();
  const int rank = a.comm()->rank();
  const TensorPlacement place = placement_of_param(a, i);
  std::vector<uint64_t> sums(sections, 0);
  std::vector<bool> from_image(sections, false);
  bool left = false;  // a section to read
  for (size_t k = 0; k < sections; ++k) {
    from_image[k] = image != nullptr && image->summed(static_cast<int>(k));
    if (from_image[k]) sums[k] = image->element_sum(i, static_cast<int>(k));
    left = left || !from_image[k];
  }
  for (const ParamPiece* lp = layout.pieces_begin(i); left && lp != layout.pieces_end(i); ++lp) {
    const BucketLayout& bl = layout.buckets[lp->bucket];
    const ShardRange mine = intersect({lp->offset, lp->offset + lp->numel}, bl.owned(rank));
    if (mine.empty()) continue;
    const auto& s = slices_of(lp->bucket);
    const int64_t first = mine.begin - rank * bl.shard;  // in the bucket's owned slice
    const int64_t param_begin = mine.begin - lp->offset + lp->param_offset;
    const int elem0 = static_cast<int>(s[0].element_size());
    if (!from_image[0]) {
      sums[0] += element_sum(kSavedElementHash, place, param_begin, mine.size(),
                             static_cast<const char*>(s[0].data_ptr()) + first * elem0, elem0)
                     .sum;
    }
    for (size_t k = 1; k < s.size(); ++k) {
      if (from_image[k]) continue;
      const SectionMap& map = state.maps[k - 1];
      const int64_t pos = bl.shard_offset + first;  // shard coordinates
      const auto [entry, count] = map.entries(pos, mine.size(), layout.slots[i].numel);
      if (count == 0) continue;
      const int64_t base = map.before(bl.shard_offset);  // the bucket slice's first entry
      const int elem = static_cast<int>(s[k].element_size());
      sums[k] += section_sum(kSavedElementHash, map.index(), place, param_begin, mine.size(),
                             layout.slots[i].numel,
                             static_cast<const char*>(s[k].data_ptr()) + (entry - base) * elem,
                             elem)
                     .sum;
    }
  }
  return sums;
}

// Writes this rank's shard file into `tmp`; returns its manifest entry.
json write_shard(ShardAccess& a, const fs::path& tmp, const std::vector<std::string>& names,
                 const std::map<std::string, at::Tensor>& tensors) {
  const auto& layout = a.layout();
  const int rank = a.comm()->rank(), world = a.comm()->size();
  const std::string file = shard_file_name(rank, world);
  // An asynchronous save's snapshot is the file's first bytes, checksummed and checked by its copy
  // (Note [Shard images]).
  const ShardImage* image = nullptr;
  if (const auto* source = dynamic_cast<const ShardImageSource*>(&a)) image = source->shard_image();
  FileWriter w(tmp / file, /*direct=*/true);  // Note [Direct shard writes]
  json sections = json::array();
  // Note [Quantised state in checkpoints]: a state section may hold other entries than elements.
  const StateSections state = state_sections(a);
  const int buckets = static_cast<int>(layout.buckets.size());
  if (image == nullptr) {
    const auto header = shard_header(rank, world);
    w.write(header.data(), header.size());
  }
  auto slice_of = [&](size_t k, int b) {
    return k == 0 ? a.owned_param_slice(b) : a.owned_state_slice(static_cast<int>(k) - 1, b);
  };
  for (size_t k = 0; k <= names.size(); ++k) {
    const std::string name = k == 0 ? std::string("param") : "state/" + names[k - 1];
    const at::ScalarType dtype = k == 0 ? a.master_dtype() : state.dtypes[k - 1];
    const int64_t entries = k == 0 ? layout.shard_numel : state.maps[k - 1].size();
    const bool elementwise = k == 0 || state.maps[k - 1].index().elementwise();
    if (image == nullptr) w.pad_to(kAlign);
    const int64_t offset = image ? image->sections().at(k).offset : w.bytes();
    SHARDOPT_INTERNAL_ASSERT(!image || (image->sections()[k].name == name &&
                                        image->sections()[k].entries == entries),
                             "section {} of the snapshot's image is {} [{}]", name,
                             image ? image->sections()[k].name : "", entries);
    int64_t written = 0;
    for (int b = 0; b < buckets; ++b) {
      const at::Tensor t = slice_of(k, b);
      SHARDOPT_INTERNAL_ASSERT(t.scalar_type() == dtype, "section {} of bucket {} is {}, not {}",
                               name, b, dtype_name(t.scalar_type()), dtype_name(dtype));
      // Never publish NaN/Inf over the last good checkpoint (the image's copy checked it).
      if (!image || !image->checked_finite(static_cast<int>(k), b)) {
        check_finite(a, b, t, k == 0 ? "value" : name, elementwise);
      }
      if (!image) w.write_tensor(t);
      written += t.numel();
    }
    SHARDOPT_INTERNAL_ASSERT(written == entries, "section {} has {} entries, its map says {}",
                             name, written, entries);
    sections.push_back({{"name", name},
                        {"offset", offset},
                        {"dtype", dtype_name(dtype)},
                        {"shape", json::array({entries})}});
  }
  if (image) {  // whole blocks straight from the image, the partial last one through w
    const int64_t whole = image->bytes() / kBlockBytes * kBlockBytes;
    w.write_blocks(image->data(), static_cast<size_t>(whole), image->block_crcs().data());
    w.write(image->data() + whole, static_cast<size_t>(image->bytes() - whole));
  }
  for (const auto& [key, t] : tensors) {
    w.pad_to(kAlign);
    const int64_t offset = w.bytes();
    w.write_tensor(t);
    sections.push_back({{"name", "trainer/" + key},
                        {"offset", offset},
                        {"dtype", dtype_name(t.scalar_type())},
                        {"shape", t.sizes().vec()}});
  }
  // Note [Block tables]: the blocks' checksums after the last whole block, in binary; the manifest
  // keeps where the table is and its own checksum.
  w.pad_to(kBlockBytes);
  const int64_t table_offset = w.bytes();
  const std::vector<uint32_t> table = w.block_crcs();
  const auto table_bytes = static_cast<int64_t>(table.size() * sizeof(uint32_t));
  const uint32_t table_crc = checksum_of(ShardChecksum::Crc32c, table.data(), table_bytes);
  w.write(table.data(), static_cast<size_t>(table_bytes));
  w.sync_and_close();
  // Note [Element checksums]: this rank's part of every parameter's sums.
  json element_sums = json::object();
  std::map<int, std::vector<at::Tensor>> on_cpu;  // bucket -> its param and state slices
  auto slices_of = [&](int b) -> const std::vector<at::Tensor>& {
    auto it = on_cpu.find(b);
    if (it != on_cpu.end()) return it->second;
    std::vector<at::Tensor> s;
    for (size_t k = 0; k <= names.size(); ++k) {
      s.push_back(slice_of(k, b).to(at::kCPU).contiguous());
    }
    return on_cpu.emplace(b, std::move(s)).first->second;
  };
  for (int i = 0; i < static_cast<int>(layout.slots.size()); ++i) {
    const std::vector<uint64_t> sums =
        element_sums_of(a, i, state, names.size() + 1, slices_of, image);
    json hex = json::array();
    for (const uint64_t v : sums) hex.push_back(fmt::format("{:016x}", v));
    element_sums[a.param_name(i)] = hex;
  }
  const ShardChecksum checksum = ShardChecksum::Crc32c;  // Note [Block checksums]
  return {{"rank", rank},
          {"element_sums", element_sums},
          {"path", file},
          {"bytes", w.bytes()},
          {checksum_key(checksum), crc_text(w.crc())},
          {"blocks",
           {{"bytes", kBlockBytes},
            {"count", table.size()},
            {"table_offset", table_offset},
            {kBlockTableCrc, crc_text(table_crc)}}},
          {"sections", sections}};
}

}  // namespace

namespace detail {

// The stored values of the model's tensors that LoadOptions::module_state names (world rank 0's,
// kept in shard file 0 as trainer tensors "module/<name>"), checked against their targets.
std::map<std::string, at::Tensor> stage_module_state(
    const Manifest& m, const std::map<std::string, at::Tensor>& targets) {
  std::map<std::string, at::Tensor> staged;
  if (targets.empty()) return staged;
  std::vector<std::string> stored;
  if (const auto it = m.j.find("module"); it != m.j.end() && it->is_object()) {
    try {
      stored = it->at("tensors").get<std::vector<std::string>>();
    } catch (const json::exception& e) {
      SHARDOPT_FAIL(Checkpoint, "checkpoint: malformed \"module\" in {}: {}", m.path.string(),
                    e.what());
    }
  }
  for (const auto& [name, target] : targets) {
    SHARDOPT_CHECK(std::find(stored.begin(), stored.end(), name) != stored.end(), Mismatch,
                   "checkpoint: {} stores no module tensor '{}' (LoadOptions::module_state); it "
                   "stores {} (SaveOptions::module_state of the save)",
                   m.path.string(), name,
                   stored.empty() ? std::string("none") : fmt::format("{}", fmt::join(stored, ", ")));
    SHARDOPT_CHECK(target.defined(), InvalidArgument,
                   "checkpoint: LoadOptions::module_state['{}'] is undefined", name);
  }
  const LoadedShard shard = load_shard(m, 0);
  for (const auto& [name, target] : targets) {
    const at::Tensor value = shard.section("trainer/" + std::string(kModulePrefix) + name);
    SHARDOPT_CHECK(value.sizes() == target.sizes() && value.scalar_type() == target.scalar_type(),
                   Mismatch,
                   "checkpoint: {}: module tensor '{}' is stored as {} {}, the model's is {} {}",
                   m.path.string(), name, dtype_name(value.scalar_type()),
                   shape_text(value.sizes().vec()), dtype_name(target.scalar_type()),
                   shape_text(target.sizes().vec()));
    staged[name] = value.clone();
  }
  return staged;
}

}  // namespace detail

// ---- save -----------------------------------------------------------------------------------

// The save by the ranks the layout is sharded over (all, or one shard group).
static void save_by_group(ShardAccess& a, const std::string& dir, const TrainerState& trainer,
                          const SaveOptions& options, std::string* manifest_crc) {
  Communicator& comm = *a.comm();
  const Duration timeout = a.zero_options().timeout;
  const int rank = comm.rank();
  at::NoGradGuard no_grad;
  Paths paths;
  std::vector<std::string> names;
  json trainer_json;
  const std::string what = fmt::format("saving checkpoint {}", dir);
  const std::string nothing = "the previous checkpoint is unchanged";

  // 1. Checks everywhere; rank 0 prepares the temporary directory.
  agree(comm, timeout, what, nothing, [&] {
    check_checkpointable(a);
    paths = paths_of(dir);
    names = optimizer_state_names(a);
    try {
      trainer_json = json::parse(trainer.json);
    } catch (const json::exception& e) {
      SHARDOPT_FAIL(InvalidArgument, "checkpoint: TrainerState::json is not valid JSON: {}",
                    e.what());
    }
    SHARDOPT_CHECK(trainer_json.is_object(), InvalidArgument,
                   "checkpoint: TrainerState::json must be a JSON object, got {}",
                   trainer_json.type_name());
    for (const auto& [key, t] : trainer.tensors) {
      SHARDOPT_CHECK(t.defined() && !key.empty(), InvalidArgument,
                     "checkpoint: TrainerState::tensors['{}'] is undefined or unnamed", key);
      dtype_name(t.scalar_type());
    }
    if (rank == 0) prepare_tmp(paths);
    return json();
  });

  // 2. Every rank writes and syncs its shard.
  const bool simulated = options.simulate_crash_after_shard_on_rank >= 0;
  const std::vector<json> files = agree(
      comm, timeout, what, nothing,
      [&] {
        json entry = write_shard(a, paths.tmp, names, trainer.tensors);
        if (options.after_shard_written) options.after_shard_written(rank);
        SHARDOPT_CHECK(options.simulate_crash_after_shard_on_rank != rank, Checkpoint,
                       "checkpoint: simulated crash on rank {} after writing {} "
                       "(SaveOptions::simulate_crash_after_shard_on_rank)",
                       rank, (paths.tmp / entry.at("path").get<std::string>()).string());
        return entry;
      },
      [&] {
        std::error_code ec;
        if (rank == 0 && !simulated) remove_tree(paths.tmp, ec);  // a crash would leave it
      });

  // 3. Rank 0 writes the manifest and publishes the directory.
  agree(
      comm, timeout, what, nothing,
      [&] {
        if (rank != 0) return json();
        json module;  // null unless the save was given the model's extras
        if (!options.module_state.empty() || !options.aliases.empty()) {
          json stored = json::array();
          for (const auto& item : options.module_state) stored.push_back(item.first);
          module = {{"tensors", stored}, {"aliases", options.aliases}};
        }
        const json manifest = build_manifest(a, names, trainer_json, files, module);
        const std::string text = dump(manifest, 1);
        {
          FileWriter w(paths.tmp / kManifest);
          w.write(text.data(), text.size());
          w.sync_and_close();
        }
        fsync_dir(paths.tmp);
        publish(paths);
        if (manifest_crc) *manifest_crc = manifest.at("manifest_crc32").get<std::string>();
        return json();
      },
      [&] {
        std::error_code ec;
        if (rank == 0) remove_tree(paths.tmp, ec);
      });
}

// Hybrid sharding: every shard group holds all shards, so the first one writes them, as a
// checkpoint of a world of shard_group_size ranks (which any layout loads); the other groups'
// ranks touch no file and learn world rank 0's outcome, so every rank returns or throws alike.
void save_checkpoint(DistributedOptimizer& optimizer, const std::string& dir,
                     const TrainerState& given, const SaveOptions& options) {
  save_folder(detail::shard_access(optimizer), dir, given, options);
}

void detail::save_folder(ShardAccess& a, const std::string& dir, const TrainerState& given,
                         const SaveOptions& options, std::string* manifest_crc) {
  // The module state travels as world rank 0's trainer tensors "module/<name>".
  TrainerState trainer = given;
  if (a.world_comm()->rank() == 0) {
    for (const auto& [name, t] : options.module_state) {
      trainer.tensors[std::string(kModulePrefix) + name] = t.detach();
    }
  }
  if (a.replicas() == 1) return save_by_group(a, dir, trainer, options, manifest_crc);
  std::string failure;
  ErrorKind kind = ErrorKind::Checkpoint;
  std::exception_ptr mine;
  if (a.replica() == 0) {
    try {
      save_by_group(a, dir, trainer, options, manifest_crc);
    } catch (const Error& e) {
      failure = e.what(), kind = e.kind(), mine = std::current_exception();
    } catch (const std::exception& e) {
      failure = e.what(), mine = std::current_exception();
    }
  }
  if (mine && failure.empty()) failure = "unknown error";
  Communicator& world = *a.world_comm();
  const Duration timeout = a.zero_options().timeout;
  at::Tensor head = at::tensor({static_cast<int64_t>(kind), static_cast<int64_t>(failure.size())},
                               at::kLong);
  world.broadcast(head, 0, true)->wait(timeout);
  const int64_t length = head[1].item<int64_t>();
  if (length == 0) {
    if (mine) std::rethrow_exception(mine);  // only world rank 0's outcome is shared
    return;
  }
  at::Tensor text = at::empty({length}, at::kByte);
  if (world.rank() == 0) std::memcpy(text.data_ptr(), failure.data(), failure.size());
  world.broadcast(text, 0, true)->wait(timeout);
  if (mine) std::rethrow_exception(mine);
  throw Error(static_cast<ErrorKind>(head[0].item<int64_t>()), world.rank(),
              fmt::format("shardopt[rank {}/{}] checkpoint: shard group 0 failed to save {}: {}",
                          world.rank(), world.size(), dir,
                          std::string(static_cast<const char*>(text.data_ptr()), length)));
}

// ---- load -----------------------------------------------------------------------------------

TrainerState load_checkpoint(DistributedOptimizer& optimizer, const std::string& dir,
                             const LoadOptions& options) {
  ShardAccess& a = detail::shard_access(optimizer);
  Communicator& comm = *a.comm();
  const int rank = comm.rank();
  at::NoGradGuard no_grad;
  Manifest m;
  Staging staging;
  TrainerState trainer;
  std::vector<Rule> rules;
  std::map<std::string, at::Tensor> module_state;

  // 1. Everything that can fail, without touching the optimizer.
  agree(comm, a.zero_options().timeout, fmt::format("loading checkpoint {}", dir),
        "no rank changed its optimizer", [&] {
          check_checkpointable(a);
          m = read_manifest(dir);
          const std::vector<std::string> names = optimizer_state_names(a);
          check_same_model(a, m);
          check_same_optimizer(a, m, names);
          for (const auto& g : m.group_rules) {
            try {
              rules.push_back(rule_from_json(g));
            } catch (const json::exception& e) {
              SHARDOPT_FAIL(Checkpoint, "checkpoint: malformed param group in {}: {}",
                            m.path.string(), e.what());
            }
          }
          staging = stage_current(a, static_cast<int>(names.size()));
          // Which saved rank's file feeds which of my elements (and the parameter's size: Note
          // [Quantised state in checkpoints]).
          std::map<int, std::vector<std::pair<detail::CopyOp, int64_t>>> by_file;
          for (int i = 0; i < static_cast<int>(a.layout().slots.size()); ++i) {
            const auto& saved = m.params[m.by_name.at(a.param_name(i))].pieces;
            for (const auto& op : detail::plan_copies(a.layout(), rank, i, saved)) {
              by_file[op.src_rank].emplace_back(op, a.layout().slots[i].numel);
            }
          }
          if (rank < m.world) by_file[rank];  // my trainer tensors
          for (const auto& [file_rank, ops] : by_file) {
            const StateSections from = saved_state_sections(a, m, file_rank);
            check_state_sections(m, m.files[static_cast<size_t>(file_rank)], names, from);
            const LoadedShard shard = load_shard(m, file_rank);
            const at::Tensor param = shard.section("param");
            std::vector<at::Tensor> state;
            for (const auto& n : names) state.push_back(shard.section("state/" + n));
            for (const auto& [op, param_numel] : ops) {
              staging.param.narrow(0, op.dst, op.numel).copy_(param.narrow(0, op.src, op.numel));
              for (size_t k = 0; k < state.size(); ++k) {
                const auto [src, count] = from.maps[k].entries(op.src, op.numel, param_numel);
                const auto [dst, n] = staging.sections.maps[k].entries(op.dst, op.numel,
                                                                       param_numel);
                SHARDOPT_INTERNAL_ASSERT(count == n, "state section {}: {} entries to {}",
                                         names[k], count, n);
                if (count > 0) staging.state[k].narrow(0, dst, n).copy_(state[k].narrow(0, src, n));
              }
            }
            if (file_rank == rank) {
              for (const auto& [name, section] : shard.file->sections) {
                if (name.rfind("trainer/", 0) == 0) {
                  trainer.tensors[name.substr(8)] = shard.section(name).clone();
                }
              }
            }
          }
          module_state = stage_module_state(m, options.module_state);
          trainer.json = dump(m.j.at("trainer"));
          if (options.restore_hyperparameters) {
            for (size_t g = 0; g < rules.size(); ++g) {
              SHARDOPT_CHECK(
                  rule_name(rules[g]) == rule_name(a.group_rule(static_cast<int>(g))), Mismatch,
                  "checkpoint: {}: param group {} runs {}, this optimizer's {}", m.path.string(), g,
                  rule_name(rules[g]), rule_name(a.group_rule(static_cast<int>(g))));
            }
          }
          return json();
        });

  // 2. Every rank succeeded: replace the state.
  commit(a, staging);
  a.set_step_count(m.step);
  // An fp16 optimizer continues with the saved scaler (checked by read_manifest); others ignore it.
  if (m.loss_scaler) a.set_loss_scaler_state(*m.loss_scaler);
  if (options.restore_hyperparameters) {
    for (size_t g = 0; g < rules.size(); ++g) a.set_group_rule(static_cast<int>(g), rules[g]);
  }
  for (const auto& [name, value] : module_state) options.module_state.at(name).copy_(value);
  a.after_load();
  return trainer;
}

// ---- DistributedOptimizer shorthands ----------------------------------------------------------

void DistributedOptimizer::save_checkpoint(const std::string& dir) {
  shardopt::save_checkpoint(*this, dir);
}
void DistributedOptimizer::load_checkpoint(const std::string& dir) {
  shardopt::load_checkpoint(*this, dir);
}

}  // namespace shardopt
