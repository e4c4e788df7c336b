// Loading a grid's checkpoint into any layout: the committed folders checked, each parameter this
// rank holds placed onto the saved copies that overlap it, and only those byte ranges read (Notes
// [One commit for a grid] in shardopt/grid_checkpoint.hpp, [Placement in the manifest] in
// placement.hpp).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: not reached through ATen.h on torch 2.6
#include <fmt/format.h>

#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "checkpoint/element_sums.hpp"
#include "checkpoint/files.hpp"
#include "checkpoint/format.hpp"
#include "checkpoint/grid_files.hpp"
#include "checkpoint/manifest.hpp"
#include "checkpoint/placement.hpp"
#include "checkpoint/ranged_reads.hpp"
#include "checkpoint/staging.hpp"
#include "comm/agreement.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/error.hpp"
#include "shardopt/grid_checkpoint.hpp"
#include "shardopt/rules.hpp"
#include "shardopt/tensor_parallel.hpp"

namespace shardopt {

namespace fs = std::filesystem;
using namespace detail;  // NOLINT(google-build-using-namespace)

namespace {

// The folders of the committed save (or a plain checkpoint as a grid of one), each checked
// against the commit record.
struct SavedGrid {
  int tp = 1, pp = 1, dp = 0;
  std::vector<Manifest> folders;  // pp-major: folders[p * tp + t]
  int64_t metadata_bytes = 0;
  const Manifest& at(int p, int t) const { return folders[static_cast<size_t>(p * tp + t)]; }
};

int64_t file_bytes(const fs::path& path) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  return ec ? 0 : static_cast<int64_t>(size);
}

SavedGrid read_saved_grid(const std::string& base) {
  SavedGrid g;
  std::error_code ec;
  if (fs::exists(fs::path(base) / kManifest, ec)) {  // save_checkpoint's folder: a grid of one
    g.folders.push_back(read_manifest(base));
    g.dp = g.folders[0].world;
    g.metadata_bytes = file_bytes(fs::path(base) / kManifest);
    return g;
  }
  const GridCommit c = read_grid_commit(base);
  g.tp = c.layout.tp, g.pp = c.layout.pp, g.dp = c.layout.dp;
  g.metadata_bytes = file_bytes(fs::path(base) / kCommitFile);
  for (size_t i = 0; i < c.folders.size(); ++i) {
    const fs::path dir = fs::path(base) / c.path / c.folders[i];
    SHARDOPT_CHECK(fs::exists(dir / kManifest, ec), Checkpoint,
                   "checkpoint: folder {} of the committed save {} (step {}) is missing",
                   dir.string(), c.path, c.step);
    Manifest m = read_manifest(dir.string());
    const std::string crc = m.j.value("manifest_crc32", std::string());
    SHARDOPT_CHECK(crc == c.manifest_crc32[i] && m.step == c.step, Checkpoint,
                   "checkpoint: {} does not belong to the committed save {} of step {} (its "
                   "manifest is of step {} with CRC-32 {}, {} names {}): a folder was replaced "
                   "or copied from another save",
                   dir.string(), c.path, c.step, m.step, crc.empty() ? "none" : crc,
                   (fs::path(base) / kCommitFile).string(), c.manifest_crc32[i]);
    g.metadata_bytes += file_bytes(dir / kManifest);
    g.folders.push_back(std::move(m));
  }
  return g;
}

// The saved copies' placement of `name` in stage folder row `p` (all of its tensor folders must
// hold it alike).
TensorPlacement saved_placement(const SavedGrid& g, int p, const std::string& name) {
  const Manifest& first = g.at(p, 0);
  const ManifestParam& mp = first.params[first.by_name.at(name)];
  TensorPlacement s;
  s.shape = mp.shape;
  if (!mp.split.empty()) {
    s.dim = mp.split[0], s.full = mp.split[1], s.padded = mp.split[2];
    s.ranks = mp.split_ranks > 0 ? mp.split_ranks : g.tp;
  }
  SHARDOPT_CHECK(!s.split() || s.ranks == g.tp, Checkpoint,
                 "checkpoint: {}: parameter '{}' records a split over {} tensor ranks, the save "
                 "has {}",
                 first.path.string(), name, s.ranks, g.tp);
  for (int t = 0; t < g.tp; ++t) {
    const Manifest& m = g.at(p, t);
    const auto it = m.by_name.find(name);
    SHARDOPT_CHECK(it != m.by_name.end(), Checkpoint,
                   "checkpoint: {} lacks parameter '{}', which {} holds: the tensor ranks' "
                   "folders of one stage must hold the same parameters",
                   m.dir.string(), name, first.dir.string());
    const ManifestParam& other = m.params[it->second];
    SHARDOPT_CHECK(other.shape == mp.shape && other.split == mp.split &&
                       (other.split_rank < 0 || !s.split() || other.split_rank == t),
                   Checkpoint,
                   "checkpoint: {}: parameter '{}' is a piece of shape {} (split {}, tensor "
                   "rank {}), where {} has {}: the pieces of one tensor disagree",
                   m.dir.string(), name, shape_text(other.shape), shape_text(other.split),
                   other.split_rank, first.dir.string(), shape_text(mp.shape));
  }
  return s;
}

// Note [Element checksums]: every parameter the save holds, in one order on every rank, with its
// saved sums (the first stage folder holding it; a split one's summed over its tensor folders).
struct SavedSums {
  std::vector<std::string> names;
  std::map<std::string, int> index;
  std::vector<std::vector<uint64_t>> sums;  // by index: values, then each state buffer
  std::vector<int64_t> numel;               // unsplit elements
  bool complete = true;                     // false: a manifest written before the sums
  ElementHash hash = ElementHash::Multiply;  // the save's (its format version's)
};

SavedSums saved_sums(const SavedGrid& g) {
  SavedSums out;
  out.hash = g.folders.at(0).element_hash;
  for (const Manifest& m : g.folders) {
    SHARDOPT_CHECK(m.element_hash == out.hash, Checkpoint,
                   "checkpoint: {} and {} hash their element sums differently (format versions "
                   "{} and {}): the folders of one save are of one version",
                   g.folders[0].path.string(), m.path.string(),
                   g.folders[0].j.at("format_version").dump(), m.j.at("format_version").dump());
  }
  for (int p = 0; p < g.pp; ++p) {
    for (const ManifestParam& mp : g.at(p, 0).params) {
      if (out.index.count(mp.name) > 0) continue;
      const TensorPlacement from = saved_placement(g, p, mp.name);
      std::vector<uint64_t> total;
      for (int t = 0; t < (from.split() ? g.tp : 1); ++t) {
        const Manifest& m = g.at(p, t);
        const auto& sums = m.params[m.by_name.at(mp.name)].sums;
        if (sums.empty()) out.complete = false;
        total.resize(sums.size(), 0);
        for (size_t k = 0; k < sums.size() && k < total.size(); ++k) total[k] += sums[k];
      }
      int64_t numel = 1;
      for (const int64_t d : from.global_shape()) numel *= d;
      out.index[mp.name] = static_cast<int>(out.names.size());
      out.names.push_back(mp.name);
      out.sums.push_back(total);
      out.numel.push_back(numel);
    }
  }
  return out;
}

// A copy into this rank's staged shard: `numel` elements at element `src` (shard coordinates) of
// the saved file, to element `dst` of the staging.
struct FileCopy {
  int64_t src = 0, dst = 0, numel = 0;
  int64_t param_numel = 0;  // the parameter's (Note [Quantised state in checkpoints])
};

}  // namespace

TrainerState load_grid_checkpoint(DistributedOptimizer& optimizer, const ParallelGroups& groups,
                                  const std::string& base, const GridLoadOptions& options) {
  ShardAccess& a = shard_access(optimizer);
  SHARDOPT_CHECK(groups.world != nullptr, InvalidArgument,
                 "checkpoint: load_grid_checkpoint needs ParallelGroups::world "
                 "(make_parallel_groups)");
  Communicator& world = *groups.world;
  const int rank = a.comm()->rank();
  at::NoGradGuard no_grad;
  SavedGrid g;
  Staging staging;
  TrainerState trainer;
  std::vector<Rule> rules;
  std::map<std::string, at::Tensor> module_state;
  GridLoadStats stats;
  SavedSums sums;
  at::Tensor staged_sums;
  std::vector<std::string> state_names;

  agree(
      world, a.zero_options().timeout, fmt::format("loading grid checkpoint {}", base),
      "no rank changed its optimizer", [&] {
        check_checkpointable(a);
        g = read_saved_grid(base);
        stats.metadata_bytes = g.metadata_bytes;
        const std::vector<std::string> names = optimizer_state_names(a);
        state_names = names;
        for (const Manifest& m : g.folders) check_same_optimizer(a, m, names);
        const Manifest& head = g.folders[0];
        for (const auto& j : head.group_rules) {
          try {
            rules.push_back(rule_from_json(j));
          } catch (const json::exception& e) {
            SHARDOPT_FAIL(Checkpoint, "checkpoint: malformed param group in {}: {}",
                          head.path.string(), e.what());
          }
        }
        staging = stage_current(a, static_cast<int>(names.size()));
        const auto& layout = a.layout();
        const int64_t elem = static_cast<int64_t>(c10::elementSize(a.master_dtype()));
        sums = saved_sums(g);
        // (folder, file rank) -> copies, in shard coordinates.
        std::map<std::pair<int, int>, std::vector<FileCopy>> copies;
        for (int i = 0; i < static_cast<int>(layout.slots.size()); ++i) {
          const std::string& name = a.param_name(i);
          int stage = -1;  // the first stage folder holding it (a tied embedding: either)
          for (int p = 0; p < g.pp && stage < 0; ++p) {
            if (g.at(p, 0).by_name.count(name) > 0) stage = p;
          }
          SHARDOPT_CHECK(stage >= 0, Mismatch,
                         "checkpoint: parameter '{}' is in none of the {} folders of {}: it is "
                         "of another model",
                         name, g.folders.size(), base);
          const TensorPlacement to = placement_of_param(a, i);
          const TensorPlacement from = saved_placement(g, stage, name);
          SHARDOPT_CHECK(to.global_shape() == from.global_shape() &&
                             (!to.split() || !from.split() || to.dim == from.dim),
                         Mismatch,
                         "checkpoint: parameter '{}' is {} unsplit{} in {}, {} unsplit{} in "
                         "this model",
                         name, shape_text(from.global_shape()),
                         from.split() ? fmt::format(" (split along dim {})", from.dim) : "", base,
                         shape_text(to.global_shape()),
                         to.split() ? fmt::format(" (split along dim {})", to.dim) : "");
          // Adafactor packs a factored state per parameter into its flat elements (Note
          // [Factored state in flat shards], src/engine/adafactor_update.hpp): not elementwise,
          // so it does not follow a split that changes.
          const bool resplit = (to.split() || from.split()) &&
                               (to.split() != from.split() || to.ranks != from.ranks);
          SHARDOPT_CHECK(!resplit || !std::holds_alternative<Adafactor>(a.group_rule(0)),
                         Unsupported,
                         "checkpoint: parameter '{}' is split over {} tensor ranks in {} and {} "
                         "here; Adafactor's factored state cannot be re-split (load at the "
                         "save's --tp, or consolidate and load_full_state)",
                         name, from.split() ? from.ranks : 1, base, to.split() ? to.ranks : 1);
          // 8-bit AdamW's blocks are of the local tensor (Note [Quantised state in checkpoints]).
          SHARDOPT_CHECK(!resplit || !std::holds_alternative<AdamW8bit>(a.group_rule(0)),
                         Unsupported,
                         "checkpoint: parameter '{}' is split over {} tensor ranks in {} and {} "
                         "here; adamw8bit's blocks are blocks of each rank's piece and cannot be "
                         "re-split (load at the save's tensor-parallel size)",
                         name, from.split() ? from.ranks : 1, base, to.split() ? to.ranks : 1);
          // A replicated parameter is in every tensor folder: spread the reads over them.
          const int whole = to.rank % g.tp;
          for (const ParamPiece* lp = layout.pieces_begin(i); lp != layout.pieces_end(i); ++lp) {
            const BucketLayout& bl = layout.buckets[lp->bucket];
            const ShardRange mine = intersect({lp->offset, lp->offset + lp->numel}, bl.owned(rank));
            if (mine.empty()) continue;
            const int64_t to_param = lp->param_offset - lp->offset;
            const int64_t dst_of_param0 = bl.shard_offset - to_param - int64_t{rank} * bl.shard;
            stats.share_bytes += mine.size() * elem * (1 + static_cast<int64_t>(names.size()));
            for (const PlacedRun& run :
                 place(to, from, mine.begin + to_param, mine.end + to_param, whole)) {
              const int folder = stage * g.tp + run.src_rank;
              const Manifest& m = g.folders[static_cast<size_t>(folder)];
              for (const SavedPiece& p : m.params[m.by_name.at(name)].pieces) {
                const int64_t lo = std::max(run.src, p.param_begin);
                const int64_t hi = std::min(run.src + run.numel, p.param_begin + p.numel);
                if (lo >= hi) continue;
                copies[{folder, p.rank}].push_back({p.shard_begin + (lo - p.param_begin),
                                                    dst_of_param0 + run.dst + (lo - run.src),
                                                    hi - lo, layout.slots[i].numel});
              }
            }
          }
        }
        // Read: every section (parameters, each state buffer) of every file, ranged.
        for (const auto& [key, list] : copies) {
          const Manifest& m = g.folders[static_cast<size_t>(key.first)];
          const ShardFile& f = m.files[static_cast<size_t>(key.second)];
          const StateSections from = saved_state_sections(a, m, key.second);
          check_state_sections(m, f, names, from);
          std::vector<RangeRead> reads;
          for (int k = -1; k < static_cast<int>(names.size()); ++k) {
            const std::string section = k < 0 ? "param" : "state/" + names[k];
            const auto it = f.sections.find(section);
            SHARDOPT_CHECK(it != f.sections.end(), Checkpoint,
                           "checkpoint: shard file {} of {} has no section '{}'", f.path,
                           m.dir.string(), section);
            const at::ScalarType dtype =
                k < 0 ? a.master_dtype() : staging.sections.dtypes[static_cast<size_t>(k)];
            SHARDOPT_CHECK(it->second.dtype == dtype, Checkpoint,
                           "checkpoint: {}/{}: section '{}' holds {}, this optimizer keeps {}",
                           m.dir.string(), f.path, section, dtype_name(it->second.dtype),
                           dtype_name(dtype));
            at::Tensor& target = k < 0 ? staging.param : staging.state[static_cast<size_t>(k)];
            auto* dst = static_cast<char*>(target.data_ptr());
            const int64_t size = static_cast<int64_t>(c10::elementSize(dtype));
            for (const FileCopy& c : list) {
              if (k < 0 || staging.sections.maps[static_cast<size_t>(k)].index().elementwise()) {
                reads.push_back(
                    {it->second.offset + c.src * size, c.numel * size, dst + c.dst * size});
                continue;
              }
              // Note [Quantised state in checkpoints]: the entries of those elements.
              const auto [src, count] =
                  from.maps[static_cast<size_t>(k)].entries(c.src, c.numel, c.param_numel);
              const auto [to, n] = staging.sections.maps[static_cast<size_t>(k)].entries(
                  c.dst, c.numel, c.param_numel);
              SHARDOPT_INTERNAL_ASSERT(count == n, "state section {}: {} entries to {}", section,
                                       count, n);
              if (n > 0) {
                reads.push_back({it->second.offset + src * size, n * size, dst + to * size});
              }
            }
          }
          stats.data_bytes += read_ranges(m, f, std::move(reads), !sums.complete);
          ++stats.files_opened;
        }
        // What this rank staged adds to every parameter's element sums.
        const size_t sections = names.size() + 1, n = sums.names.size();
        staged_sums = at::zeros({static_cast<int64_t>(n * (sections + 1))}, at::kLong);
        auto* acc = staged_sums.data_ptr<int64_t>();
        for (int i = 0; sums.complete && i < static_cast<int>(layout.slots.size()); ++i) {
          const size_t gi = static_cast<size_t>(sums.index.at(a.param_name(i)));
          const TensorPlacement to = placement_of_param(a, i);
          for (const ParamPiece* lp = layout.pieces_begin(i); lp != layout.pieces_end(i); ++lp) {
            const BucketLayout& bl = layout.buckets[lp->bucket];
            const ShardRange mine = intersect({lp->offset, lp->offset + lp->numel}, bl.owned(rank));
            if (mine.empty()) continue;
            const int64_t dst = bl.shard_offset + mine.begin - int64_t{rank} * bl.shard;
            const int64_t param_begin = mine.begin - lp->offset + lp->param_offset;
            const int64_t param_numel = layout.slots[i].numel;
            for (size_t k = 0; k < sections; ++k) {
              const at::Tensor& t = k == 0 ? staging.param : staging.state[k - 1];
              const int size = static_cast<int>(t.element_size());
              ElementSum e;
              if (k == 0) {
                e = element_sum(sums.hash, to, param_begin, mine.size(),
                                static_cast<const char*>(t.data_ptr()) + dst * size, size);
              } else {
                const SectionMap& map = staging.sections.maps[k - 1];
                const auto [entry, count] = map.entries(dst, mine.size(), param_numel);
                if (count == 0) continue;
                e = section_sum(sums.hash, map.index(), to, param_begin, mine.size(), param_numel,
                                static_cast<const char*>(t.data_ptr()) + entry * size, size);
              }
              acc[gi * sections + k] =
                  static_cast<int64_t>(static_cast<uint64_t>(acc[gi * sections + k]) + e.sum);
              if (k == 0) acc[n * sections + gi] += e.count;
            }
          }
        }
        // This rank's trainer tensors, where the save had the same grid (and this data-parallel
        // rank).
        if (g.tp == groups.layout.tp && g.pp == groups.layout.pp) {
          const Manifest& own = g.at(groups.pp_rank, groups.tp_rank);
          if (rank < own.world) {
            const ShardFile& f = own.files[static_cast<size_t>(rank)];
            std::vector<RangeRead> reads;
            for (const auto& [section, s] : f.sections) {
              if (section.rfind("trainer/", 0) != 0) continue;
              at::Tensor t = at::empty(s.shape, at::TensorOptions().dtype(s.dtype));
              reads.push_back(
                  {s.offset, static_cast<int64_t>(t.nbytes()), static_cast<char*>(t.data_ptr())});
              trainer.tensors[section.substr(8)] = t;
            }
            stats.data_bytes += read_ranges(own, f, std::move(reads));
          }
        }
        if (!options.load.module_state.empty()) {
          module_state = stage_module_state(head, options.load.module_state);
        }
        trainer.json = dump(head.j.at("trainer"));
        return json();
      });

  // Note [Element checksums]: the sums over every copy the new layout holds, checked on every rank.
  if (sums.complete) {
    world.all_reduce(staged_sums, ReduceOp::Sum, true)->wait(a.zero_options().timeout);
    agree(world, a.zero_options().timeout, fmt::format("loading grid checkpoint {}", base),
          "no rank changed its optimizer", [&] {
            const size_t sections = state_names.size() + 1, n = sums.names.size();
            const auto* acc = staged_sums.data_ptr<int64_t>();
            for (size_t gi = 0; gi < n; ++gi) {
              const int64_t count = acc[n * sections + gi], numel = sums.numel[gi];
              if (count == 0 || numel == 0) continue;  // not held by this layout
              SHARDOPT_CHECK(count % numel == 0, Checkpoint,
                             "checkpoint: {}: the copies of parameter '{}' this layout loaded "
                             "cover {} elements, not a multiple of its {}",
                             base, sums.names[gi], count, numel);
              const uint64_t copies = static_cast<uint64_t>(count / numel);
              for (size_t k = 0; k < sections; ++k) {
                const uint64_t got = static_cast<uint64_t>(acc[gi * sections + k]);
                const uint64_t want = copies * sums.sums[gi][k];
                SHARDOPT_CHECK(got == want, Checkpoint,
                               "checkpoint: {}: the {} of parameter '{}' as loaded do not match "
                               "the checkpoint's element checksum ({:016x}, expected {:016x}); "
                               "a shard file is corrupt",
                               base, k == 0 ? std::string("values") : state_names[k - 1],
                               sums.names[gi], got, want);
              }
            }
            return json();
          });
  }

  // Every rank succeeded: replace the state.
  commit(a, staging);
  a.set_step_count(g.folders[0].step);
  if (g.folders[0].loss_scaler) a.set_loss_scaler_state(*g.folders[0].loss_scaler);
  if (options.load.restore_hyperparameters) {
    for (size_t k = 0; k < rules.size(); ++k) a.set_group_rule(static_cast<int>(k), rules[k]);
  }
  for (const auto& [name, value] : module_state) options.load.module_state.at(name).copy_(value);
  a.after_load();
  if (options.stats != nullptr) *options.stats = stats;
  return trainer;
}

}  // namespace shardopt
