// The whole model of a grid's committed save, in one process: every (pipeline, tensor) folder's
// parameters put back together (read_grid_full_state in grid_files.hpp).
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/grid_files.hpp"
#include "checkpoint/manifest.hpp"
#include "shardopt/error.hpp"
#include "shardopt/grid_checkpoint.hpp"

namespace shardopt::detail {

namespace fs = std::filesystem;

FullState read_grid_full_state(const std::string& base) {
  std::error_code ec;
  if (fs::exists(fs::path(base) / "manifest.json", ec)) return read_full_state(base);
  const GridCommit c = read_grid_commit(base);
  // By name: the copies of the first pipeline stage that holds it (a tied embedding is saved by
  // two), one per tensor rank when split (Note [Placement in the manifest]).
  struct Copies {
    int pp = -1;
    std::vector<int64_t> split;  // {dim, full_size, padded_size}; empty: whole
    std::vector<at::Tensor> by_rank;
  };
  std::map<std::string, Copies> found;
  std::vector<std::string> order;
  FullState out;
  for (int pp = 0; pp < c.layout.pp; ++pp) {
    for (int tp = 0; tp < c.layout.tp; ++tp) {
      const std::string folder = committed_folder(base, tp, pp);
      const Manifest m = read_manifest(folder);
      FullState part = read_full_state(folder);
      for (const auto& p : m.params) {
        auto [it, fresh] = found.try_emplace(p.name);
        Copies& copies = it->second;
        if (fresh) {
          order.push_back(p.name);
          copies.pp = pp;
          copies.split = p.split;
          copies.by_rank.resize(copies.split.empty() ? 1 : c.layout.tp);
        }
        if (copies.pp != pp) continue;  // another stage's copy of a tied parameter
        SHARDOPT_CHECK(copies.split == p.split, Checkpoint,
                       "checkpoint: {}: '{}' is split as [{}] in {} but otherwise in another "
                       "tensor rank's folder", base, p.name, fmt::join(p.split, ", "), folder);
        const int slot = copies.split.empty() ? 0 : (p.split_rank >= 0 ? p.split_rank : tp);
        SHARDOPT_CHECK(slot < static_cast<int>(copies.by_rank.size()), Checkpoint,
                       "checkpoint: {}: '{}' in {} is tensor rank {} of a grid of tp={}", base,
                       p.name, folder, slot, c.layout.tp);
        if (!copies.by_rank[slot].defined()) copies.by_rank[slot] = part.params[p.name];
      }
      for (const auto& [alias, name] : part.aliases) out.aliases.emplace(alias, name);
      for (const auto& [name, t] : part.module_state) out.module_state.emplace(name, t);
      if (pp == 0 && tp == 0) out.step = part.step;
    }
  }
  for (const auto& name : order) {
    Copies& copies = found.at(name);
    for (size_t r = 0; r < copies.by_rank.size(); ++r) {
      SHARDOPT_CHECK(copies.by_rank[r].defined(), Checkpoint,
                     "checkpoint: {}: no folder holds tensor rank {}'s part of '{}'", base, r, name);
    }
    if (copies.split.empty()) {
      out.params.insert(name, copies.by_rank[0]);
      continue;
    }
    const int64_t dim = copies.split[0], full = copies.split[1];
    out.params.insert(name, at::cat(copies.by_rank, dim).narrow(dim, 0, full).contiguous());
    copies.by_rank.clear();  // the slices go as the whole tensor is made
  }
  return out;
}

}  // namespace shardopt::detail
