// Checkpoints of 8-bit AdamW's quantised state (Note [Quantised state in checkpoints] in
// shardopt/detail/state_sections.hpp): saved at N ranks and stage s (save_checkpoint, and an
// asynchronous grid save; hybrid sharding at W = 4), loaded at M = 1..W ranks and every stage
// with other buckets (load_checkpoint, load_grid_checkpoint), the continued run is bitwise the run
// at M that was never interrupted. Mismatched or edited checkpoints fail by name on every rank; the paths that
// hand the state out per element refuse adamw8bit by name. Also the bytes per parameter on disk.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "shardopt/async_checkpoint.hpp"
#include "shardopt/checkpoint.hpp"
#include "shardopt/grid_checkpoint.hpp"
#include "shardopt/parallel_layout.hpp"
#include "support/adam8bit_model.hpp"
#include "support/dist_env.hpp"
#include "support/expect_error.hpp"
#include "support/first_ranks.hpp"

namespace shardopt {
namespace {

namespace fs = std::filesystem;
using test::adam8bit::Net;
using test::adam8bit::rule;

constexpr int64_t kSaveAt = 4, kEnd = 8;

ZeroOptions options(int stage, int64_t bucket_bytes) {
  ZeroOptions zo;
  zo.stage = stage_from_int(stage);
  zo.bucket_bytes = bucket_bytes;
  zo.timeout = std::chrono::seconds(60);
  return zo;
}

void train(DistributedOptimizer& opt, Net& net, int64_t from, int64_t to) {
  for (int64_t s = from; s < to; ++s) {
    opt.zero_grad();
    opt.backward(net.loss(s));
    opt.step();
  }
}

std::vector<at::Tensor> values(DistributedOptimizer& opt, const Net& net) {
  opt.gather_full_parameters();  // stage 3: units hold no storage between steps
  std::vector<at::Tensor> out;
  for (const auto& p : net.params) out.push_back(p.detach().clone());
  return out;
}

// The first parameter that differs in any bit ("" when none).
std::string first_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  for (size_t p = 0; p < a.size(); ++p) {
    if (!at::equal(a[p], b[p])) {
      return fmt::format("{} (max diff {:.3g})", test::adam8bit::kShapes[p].name,
                         (a[p] - b[p]).abs().max().item<double>());
    }
  }
  return "";
}

void remove_shared(const std::string& dir) {
  test::world()->barrier();
  std::error_code ec;
  if (test::world()->rank() == 0) fs::remove_all(dir, ec);
}

// A grid of data parallelism alone over `comm` (for the grid checkpoint functions).
ParallelGroups dp_grid(const CommunicatorPtr& comm) {
  return make_parallel_groups(comm, ParallelLayout{1, 1, comm->size()});
}

constexpr int64_t kSmallBuckets = 4 * 3000;  // the large parameters split across buckets
constexpr int64_t kOtherBuckets = 4 * 7000;

DIST_TEST(Adam8bitCheckpoint, ResumesBitwiseAtAnyNAndStage) {
  const int world = test::world()->size();
  const std::string base = test::shared_dir("adam8bit-ckpt");
  // Hybrid sharding (shard groups of 2, replicated across them) where the world has several.
  const bool hybrid = world % 2 == 0 && world > 2;
  struct Save {
    int n, stage;
    bool grid;  // an asynchronous grid save, loaded by load_grid_checkpoint
    std::string dir;
    int shard_group = 0;
  };
  std::vector<Save> saves = {{world, 2, false, base + "/all"},
                             {1, 3, false, base + "/one"},
                             {std::min(2, world), 0, true, base + "/grid"}};
  if (hybrid) saves.push_back({world, 1, false, base + "/hybrid", 2});
  for (const Save& s : saves) {
    auto comm = test::first_ranks(s.n);
    if (!comm) continue;
    Net net;
    if (s.grid) {
      const ParallelGroups g = dp_grid(comm);
      ZeroOptions zo = options(s.stage, kSmallBuckets);
      zo.grid = g;
      DistributedOptimizer opt(net.groups(), rule(), g.dp, zo);
      train(opt, net, 0, kSaveAt);
      AsyncCheckpoint saver(opt, g);
      saver.save_checkpoint_async(s.dir, {R"({"at": 4})", {}});
      train(opt, net, kSaveAt, kSaveAt + 1);  // the snapshot, not the optimizer, is written
      saver.wait();
    } else {
      ZeroOptions zo = options(s.stage, kSmallBuckets);
      zo.shard_group_size = s.shard_group;
      DistributedOptimizer opt(net.groups(), rule(), comm, zo);
      train(opt, net, 0, kSaveAt);
      save_checkpoint(opt, s.dir, {R"({"at": 4})", {}});
      // Hybrid: shard group 0 wrote it, as a world of one shard group.
      EXPECT_EQ(read_checkpoint_info(s.dir).world_size, s.shard_group > 0 ? s.shard_group : s.n);
    }
  }
  test::world()->barrier();

  bool ok = true;
  for (int m = 1; m <= world; ++m) {
    auto comm = test::first_ranks(m);
    if (!comm) continue;
    for (int stage : {0, 1, 2, 3}) {
      const int64_t buckets = stage % 2 == 1 ? kOtherBuckets : kSmallBuckets;
      // The run at M and this stage that was never interrupted.
      Net whole;
      DistributedOptimizer uninterrupted(whole.groups(), rule(), comm, options(stage, buckets));
      train(uninterrupted, whole, 0, kEnd);
      const auto want = values(uninterrupted, whole);
      EXPECT_GT((want[0] - Net().params[0].detach()).abs().max().item<double>(), 1e-3);
      // Every save, and at M = W with hybrid sharding the flat saves again into shard groups of 2
      // (the result does not depend on how the ranks shard: the flat run is the reference).
      std::vector<std::pair<const Save*, int>> loads;
      for (const Save& s : saves) loads.emplace_back(&s, 0);
      if (hybrid && m == world) {
        for (const Save& s : saves) {
          if (!s.grid) loads.emplace_back(&s, 2);
        }
      }
      for (const auto& [save, group] : loads) {
        const Save& s = *save;
        SCOPED_TRACE(fmt::format("saved at N={} stage {}{}{}, loaded at M={} stage {}{}", s.n,
                                 s.stage, s.grid ? " (async grid)" : "",
                                 s.shard_group > 0 ? " (hybrid)" : "", m, stage,
                                 group > 0 ? " (hybrid)" : ""));
        Net net;
        std::unique_ptr<DistributedOptimizer> opt;
        TrainerState t;
        if (s.grid) {
          const ParallelGroups g = dp_grid(comm);
          ZeroOptions zo = options(stage, buckets);
          zo.grid = g;
          opt = std::make_unique<DistributedOptimizer>(net.groups(), rule(), g.dp, zo);
          t = load_grid_checkpoint(*opt, g, s.dir);
        } else {
          ZeroOptions zo = options(stage, buckets);
          zo.shard_group_size = group;
          opt = std::make_unique<DistributedOptimizer>(net.groups(), rule(), comm, zo);
          t = load_checkpoint(*opt, s.dir);
        }
        EXPECT_EQ(t.json, R"({"at":4})");
        EXPECT_EQ(opt->last_step().step, kSaveAt);
        train(*opt, net, kSaveAt, kEnd);
        const std::string differs = first_difference(values(*opt, net), want);
        EXPECT_EQ(differs, "") << "not bitwise the uninterrupted run";
        ok = ok && differs.empty();
      }
    }
  }
  EXPECT_TRUE(test::all_ranks(ok));
  remove_shared(base);
}

// Where an 8-bit checkpoint does not fit or is corrupt, every rank fails with a named error and no
// optimizer changes; the per-element paths (state dicts, full states) refuse adamw8bit by name.
DIST_TEST(Adam8bitCheckpoint, MismatchedOrEditedCheckpointsFailByName) {
  const std::string base = test::shared_dir("adam8bit-bad");
  const std::string dir = base + "/ckpt";
  auto comm = test::world();
  {
    Net net;
    DistributedOptimizer opt(net.groups(), rule(), comm, options(1, kSmallBuckets));
    train(opt, net, 0, 2);
    save_checkpoint(opt, dir);
    // The torch state-dict form has no place for blocks.
    test::expect_error([&] { opt.consolidate_state_dict(0); }, ErrorKind::Unsupported,
                       {"consolidate_state_dict", "adamw8bit", "save_checkpoint"});
  }
  test::expect_error([&] { read_full_state(dir, /*with_optimizer_state=*/true); },
                     ErrorKind::Unsupported, {"read_full_state", "adamw8bit"});
  EXPECT_NO_THROW(read_full_state(dir, /*with_optimizer_state=*/false));
  auto fresh_fails = [&](const Rule& r, ErrorKind kind, const std::vector<std::string>& needles) {
    Net net;
    DistributedOptimizer opt(net.groups(), r, comm, options(2, kOtherBuckets));
    const auto before = values(opt, net);
    test::expect_error([&] { load_checkpoint(opt, dir); }, kind, needles);
    EXPECT_EQ(first_difference(values(opt, net), before), "");
    EXPECT_EQ(opt.last_step().step, 0);
  };
  // Other small parameters: other sections, so no load.
  fresh_fails(rule().min_8bit_size(100), ErrorKind::Mismatch, {"min_8bit_size 4096", "100"});
  // Another rule.
  fresh_fails(AdamW(1e-2), ErrorKind::Mismatch, {"adamw8bit", "this optimizer runs adamw"});
  // A manifest edited so that a block-maxima section is one entry short (its checksum dropped,
  // as manifests written before checksums have none): the loader's own count catches it.
  const fs::path manifest = fs::path(dir) / "manifest.json";
  nlohmann::json original;
  {
    std::ifstream in(manifest);
    in >> original;
  }
  test::world()->barrier();
  if (test::world()->rank() == 0) {
    nlohmann::json j = original;
    j.erase("manifest_crc32");
    for (auto& s : j["files"][0]["sections"]) {
      if (s["name"] == "state/absmax1") s["shape"][0] = s["shape"][0].get<int64_t>() - 1;
    }
    std::ofstream(manifest) << j.dump();
  }
  test::world()->barrier();
  fresh_fails(rule(), ErrorKind::Checkpoint, {"state/absmax1", "expected float32"});
  // One flipped bit in rank 0's codes (the manifest as saved): the whole file's CRC-32 catches it
  // on load_checkpoint, the element checksums of the codes on a grid load, which reads ranges.
  test::world()->barrier();
  if (test::world()->rank() == 0) {
    std::ofstream(manifest) << original.dump(1);
    int64_t offset = -1;
    for (const auto& s : original["files"][0]["sections"]) {
      if (s["name"] == "state/state1") offset = s["offset"].get<int64_t>();
    }
    std::fstream f(fs::path(dir) / original["files"][0]["path"].get<std::string>(),
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(offset + 10);
    const char c = static_cast<char>(f.get() ^ 0x10);
    f.seekp(offset + 10);
    f.put(c);
  }
  test::world()->barrier();
  fresh_fails(rule(), ErrorKind::Checkpoint, {"checksum mismatch"});
  {
    Net net;
    const ParallelGroups g = dp_grid(comm);
    ZeroOptions zo = options(0, kSmallBuckets);
    zo.grid = g;
    DistributedOptimizer opt(net.groups(), rule(), g.dp, zo);
    test::expect_error([&] { load_grid_checkpoint(opt, g, dir); }, ErrorKind::Checkpoint,
                       {"the state1 of parameter", "element checksum"});
    EXPECT_EQ(opt.last_step().step, 0);
  }
  EXPECT_TRUE(test::all_ranks(true));  // every rank got here
  remove_shared(base);
}

// Bytes on disk per parameter of a model of 2^20 + 1024 parameters (one small), saved at stage 2:
// 8-bit AdamW's 4 + 2 + 8/256 (+ 8 for the small parameter) against AdamW's 12.
DIST_TEST(Adam8bitCheckpoint, BytesPerParameter) {
  const std::string base = test::shared_dir("adam8bit-bytes");
  double per_param[2] = {0, 0};
  for (int k = 0; k < 2; ++k) {
    at::Tensor w = at::arange(1 << 20, at::kFloat).mul(1e-3).sin().reshape({1024, 1024});
    at::Tensor b = at::zeros({1024});
    w.set_requires_grad(true), b.set_requires_grad(true);
    ParamGroup g;
    g.params = {{"w", w}, {"b", b}};
    const Rule r = k == 0 ? Rule(rule()) : Rule(AdamW(1e-2));
    DistributedOptimizer opt({g}, r, test::world(), options(2, 4 << 20));
    opt.zero_grad();
    opt.backward((w * w).sum() + (b - 1).pow(2).sum());
    opt.step();
    const std::string dir = base + (k == 0 ? "/adamw8bit" : "/adamw");
    save_checkpoint(opt, dir);
    int64_t bytes = 0;
    for (const auto& e : fs::directory_iterator(dir)) bytes += static_cast<int64_t>(e.file_size());
    per_param[k] = static_cast<double>(bytes) / static_cast<double>(w.numel() + b.numel());
  }
  if (test::world()->rank() == 0) {
    std::printf("[adamw8bit checkpoint] N=%d: %.3f bytes per parameter on disk, adamw %.3f\n",
                test::world()->size(), per_param[0], per_param[1]);
  }
  EXPECT_LE(per_param[0], 6.1);
  EXPECT_GE(per_param[1], 12.0);
  remove_shared(base);
}

}  // namespace
}  // namespace shardopt
