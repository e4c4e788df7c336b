// Saving a grid's checkpoint: every (pipeline, tensor) folder written by its data-parallel ranks,
// then one commit record for all of them (Note [One commit for a grid] in
// shardopt/grid_checkpoint.hpp); reading that record.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/files.hpp"
#include "checkpoint/format.hpp"
#include "checkpoint/grid_files.hpp"
#include "checkpoint/manifest.hpp"
#include "checkpoint/saving.hpp"
#include "comm/agreement.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/error.hpp"
#include "shardopt/grid_checkpoint.hpp"

namespace shardopt {

namespace fs = std::filesystem;
using detail::json;

std::string grid_folder_name(int tp_rank, int tp, int pp_rank, int pp) {
  return fmt::format("pp{}-of-{}/tp{}-of-{}", pp_rank, pp, tp_rank, tp);
}

namespace detail {

namespace {

uint32_t commit_crc(json j) {
  j.erase("commit_crc32");
  std::string text = dump(j);
  return crc_of(at::from_blob(text.data(), {static_cast<int64_t>(text.size())}, at::kByte));
}

std::string save_name(int64_t number) { return fmt::format("save-{:06d}", number); }

}  // namespace

GridCommit parse_grid_commit(const std::string& text, const std::string& base) {
  const fs::path path = fs::path(base) / kCommitFile;
  GridCommit c;
  try {
    const json j = json::parse(text);
    SHARDOPT_CHECK(j.is_object() && j.value("format", "") == kCommitFormat, Checkpoint,
                   "checkpoint: {} is not a shardopt grid commit (\"format\" should be \"{}\")",
                   path.string(), kCommitFormat);
    const std::string saved = j.at("commit_crc32").get<std::string>();
    SHARDOPT_CHECK(saved == crc_text(commit_crc(j)), Checkpoint,
                   "checkpoint: checksum mismatch in {}: CRC-32 is {}, the record says {}; it was "
                   "edited or is corrupt",
                   path.string(), crc_text(commit_crc(j)), saved);
    c.save = j.at("save").get<int64_t>();
    c.step = j.at("step").get<int64_t>();
    c.path = j.at("path").get<std::string>();
    c.layout.tp = j.at("layout").at("tp").get<int>();
    c.layout.pp = j.at("layout").at("pp").get<int>();
    c.layout.dp = j.at("layout").at("dp").get<int>();
    SHARDOPT_CHECK(c.path == save_name(c.save) && c.layout.tp >= 1 && c.layout.pp >= 1 &&
                       c.layout.dp >= 1 && c.step >= 0,
                   Checkpoint,
                   "checkpoint: {}: save {} at '{}' with grid tp={} pp={} dp={} does not fit "
                   "together; it was edited or is corrupt",
                   path.string(), c.save, c.path, c.layout.tp, c.layout.pp, c.layout.dp);
    for (const auto& f : j.at("folders")) {
      c.folders.push_back(f.at("path").get<std::string>());
      c.manifest_crc32.push_back(f.at("manifest_crc32").get<std::string>());
    }
    SHARDOPT_CHECK(static_cast<int64_t>(c.folders.size()) == int64_t{c.layout.tp} * c.layout.pp,
                   Checkpoint, "checkpoint: {} lists {} folders for a grid of tp={} x pp={}",
                   path.string(), c.folders.size(), c.layout.tp, c.layout.pp);
    for (int p = 0; p < c.layout.pp; ++p) {
      for (int t = 0; t < c.layout.tp; ++t) {
        const std::string want = grid_folder_name(t, c.layout.tp, p, c.layout.pp);
        SHARDOPT_CHECK(c.folders[p * c.layout.tp + t] == want, Checkpoint,
                       "checkpoint: {}: folder #{} is '{}', expected '{}'", path.string(),
                       p * c.layout.tp + t, c.folders[p * c.layout.tp + t], want);
      }
    }
    c.kept = j.at("kept").get<std::vector<std::string>>();
  } catch (const json::exception& e) {
    SHARDOPT_FAIL(Checkpoint, "checkpoint: malformed grid commit {}: {}", path.string(), e.what());
  }
  return c;
}

}  // namespace detail

using namespace detail;  // NOLINT(google-build-using-namespace)

GridCommit read_grid_commit(const std::string& base) {
  const fs::path path = fs::path(base) / kCommitFile;
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    std::vector<std::string> saves;
    for (const auto& e : fs::directory_iterator(base, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("save-", 0) == 0) saves.push_back(name);
    }
    SHARDOPT_FAIL(Checkpoint, "checkpoint: no committed checkpoint at {}: {} does not exist{}",
                  base, path.string(),
                  saves.empty() ? std::string()
                                : fmt::format(" (found {}: a save that never committed: the "
                                              "run stopped before every folder was written)",
                                              saves.back()));
  }
  const at::Tensor bytes = read_bytes(path, "grid commit");
  return parse_grid_commit(
      std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel())),
      base);
}

std::string committed_folder(const std::string& base, int tp_rank, int pp_rank) {
  std::error_code ec;
  if (fs::exists(fs::path(base) / kManifest, ec)) return base;
  const GridCommit c = read_grid_commit(base);
  SHARDOPT_CHECK(tp_rank >= 0 && tp_rank < c.layout.tp && pp_rank >= 0 && pp_rank < c.layout.pp,
                 Checkpoint,
                 "checkpoint: {} is a grid of tp={} x pp={}; it has no position (tensor rank {}, "
                 "pipeline rank {})",
                 base, c.layout.tp, c.layout.pp, tp_rank, pp_rank);
  const size_t index = static_cast<size_t>(pp_rank * c.layout.tp + tp_rank);
  return (fs::path(base) / c.path / c.folders[index]).string();
}

void save_grid_checkpoint(DistributedOptimizer& optimizer, const ParallelGroups& groups,
                          const std::string& base, const TrainerState& trainer,
                          const SaveOptions& options, const GridSaveOptions& grid) {
  SHARDOPT_CHECK(
      groups.world != nullptr, InvalidArgument,
      "checkpoint: save_grid_checkpoint needs ParallelGroups::world (make_parallel_groups)");
  save_grid(shard_access(optimizer), *groups.world, groups, base, trainer, options, grid);
}

void detail::save_grid(ShardAccess& a, Communicator& world, const ParallelGroups& groups,
                       const std::string& base, const TrainerState& trainer,
                       const SaveOptions& options, const GridSaveOptions& grid) {
  const Duration timeout = a.zero_options().timeout;
  const int tp = groups.layout.tp, pp = groups.layout.pp;
  const std::string what = fmt::format("saving grid checkpoint {}", base);
  const std::string nothing = "the last committed checkpoint is unchanged";

  // 1. World rank 0 numbers the save and removes what a crashed save left (never a kept one).
  const auto numbers = agree(world, timeout, what, nothing, [&] {
    SHARDOPT_CHECK(grid.keep >= 1, InvalidArgument,
                   "checkpoint: GridSaveOptions::keep must be at least 1, got {}", grid.keep);
    SHARDOPT_CHECK(a.world_comm()->size() * tp * pp == world.size(), InvalidArgument,
                   "checkpoint: the optimizer's {} data-parallel ranks x tp={} x pp={} are not "
                   "the world's {} ranks",
                   a.world_comm()->size(), tp, pp, world.size());
    if (world.rank() != 0) return json();
    std::error_code ec;
    fs::create_directories(base, ec);
    SHARDOPT_CHECK(!ec, Checkpoint, "checkpoint: cannot create {}: {}", base, ec.message());
    int64_t last = 0;
    std::vector<std::string> kept;
    if (fs::exists(fs::path(base) / kCommitFile, ec)) {
      const GridCommit c = read_grid_commit(base);
      last = c.save;
      kept = c.kept;
    }
    for (const auto& e : fs::directory_iterator(base, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("save-", 0) == 0 && std::find(kept.begin(), kept.end(), name) == kept.end()) {
        remove_tree(e.path(), ec);
      }
    }
    return json(last + 1);
  });
  const int64_t number = numbers.at(0).get<int64_t>();
  const fs::path save_dir = fs::path(base) / save_name(number);

  // 2. Every position writes its folder (collective over its data-parallel ranks).
  const std::string own_folder = grid_folder_name(groups.tp_rank, tp, groups.pp_rank, pp);
  std::string own_crc;  // the manifest_crc32 of the folder this rank wrote the manifest of, if any
  agree(world, timeout, what, nothing, [&] {
    const fs::path folder = save_dir / own_folder;
    std::error_code ec;
    fs::create_directories(folder.parent_path(), ec);
    SHARDOPT_CHECK(!ec, Checkpoint, "checkpoint: cannot create {}: {}",
                   folder.parent_path().string(), ec.message());
    save_folder(a, folder.string(), trainer, options, &own_crc);
    if (grid.after_folder_written) grid.after_folder_written(world.rank());
    return json();
  });

  // 3. World rank 0 checks every folder (reading back the manifests other ranks wrote: all ranks
  // must see one filesystem) and commits them with one record, then prunes.
  agree(world, timeout, what, nothing, [&] {
    if (world.rank() != 0) return json();
    json folders = json::array();
    for (int p = 0; p < pp; ++p) {
      for (int t = 0; t < tp; ++t) {
        const std::string name = grid_folder_name(t, tp, p, pp);
        if (name == own_folder && !own_crc.empty()) {  // written here, of this step: not read back
          folders.push_back({{"path", name}, {"manifest_crc32", own_crc}});
          continue;
        }
        const Manifest m = read_manifest((save_dir / name).string());
        SHARDOPT_CHECK(m.step == a.step_count(), Checkpoint,
                       "checkpoint: {} holds step {}, the save is of step {}", m.path.string(),
                       m.step, a.step_count());
        folders.push_back({{"path", name}, {"manifest_crc32", m.j.at("manifest_crc32")}});
      }
    }
    GridCommit previous;
    std::error_code ec;
    if (fs::exists(fs::path(base) / kCommitFile, ec)) previous = read_grid_commit(base);
    std::vector<std::string> kept = previous.kept;
    kept.push_back(save_name(number));
    if (static_cast<int>(kept.size()) > grid.keep) kept.erase(kept.begin(), kept.end() - grid.keep);
    json j = {{"format", kCommitFormat},
              {"format_version", 1},
              {"save", number},
              {"step", a.step_count()},
              {"path", save_name(number)},
              {"layout", {{"tp", tp}, {"pp", pp}, {"dp", groups.layout.dp}}},
              {"folders", folders},
              {"kept", kept}};
    j["commit_crc32"] = crc_text(commit_crc(j));
    if (grid.before_commit) grid.before_commit();
    fsync_dir(save_dir);
    const std::string text = dump(j, 1);
    write_file_atomically(fs::path(base) / kCommitFile, text.data(), text.size());
    // Committed: older saves beyond `keep` go (a failure here leaves them, never the commit).
    for (const auto& e : fs::directory_iterator(base, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("save-", 0) == 0 && std::find(kept.begin(), kept.end(), name) == kept.end()) {
        remove_tree(e.path(), ec);
      }
    }
    return json();
  });
}

}  // namespace shardopt
