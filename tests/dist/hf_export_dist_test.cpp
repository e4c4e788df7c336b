// The streaming Hugging Face export (shardopt/hf_export.hpp) of a test model of split layers (a
// vocab-parallel embedding with padding, tied and pipeline-shared; column- and row-parallel
// layers; a buffer no optimizer holds) at every (t, p, d) grid of the world and ZeRO stages 0-3:
// read back by the safetensors reader, every tensor equals the unsplit value bitwise under each of
// its names, files are k-of-n with the index naming each name's file, small max_shard_bytes gives
// several files per stage; a failure on one rank fails every rank and leaves the earlier export in
// place; a directory holding other files is refused. 1-4 ranks (threads or mpirun).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "shardopt/error.hpp"
#include "shardopt/hf_export.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/parallel_layout.hpp"
#include "shardopt/pipeline_runner.hpp"
#include "shardopt/safetensors.hpp"
#include "shardopt/tensor_parallel.hpp"
#include "support/dist_env.hpp"

namespace shardopt {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kVocab = 60, kPadded = 64, kHidden = 16, kFfn = 32;
constexpr int kLayers = 12;  // divides by every p of 1-4 ranks

// The unsplit values by export name, alike on every rank.
std::map<std::string, at::Tensor> whole_values() {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(31);
  std::map<std::string, at::Tensor> w;
  w["embed.weight"] = at::randn({kVocab, kHidden}, gen);
  for (int l = 0; l < kLayers; ++l) {
    w[fmt::format("layer{}.up.weight", l)] = at::randn({kFfn, kHidden}, gen);
    w[fmt::format("layer{}.up.bias", l)] = at::randn({kFfn}, gen);
    w[fmt::format("layer{}.down.weight", l)] = at::randn({kHidden, kFfn}, gen);
    w[fmt::format("layer{}.down.bias", l)] = at::randn({kHidden}, gen);
  }
  w["scale"] = at::randn({kHidden}, gen);
  return w;
}

struct Case {
  int tp, pp, stage;
};

// One rank's part of the model at `layout`, its optimizer, and the tensors it exports.
struct Part {
  ParallelGroups g;
  tp::VocabParallelEmbedding embedding{nullptr};
  std::vector<tp::ColumnParallelLinear> up;
  std::vector<tp::RowParallelLinear> down;
  at::Tensor scale;
  std::unique_ptr<DistributedOptimizer> opt;
  torch::OrderedDict<std::string, at::Tensor> tensors;

  Part(const Case& c, const std::map<std::string, at::Tensor>& w) {
    g = make_parallel_groups(test::world(), ParallelLayout{c.tp, c.pp, 0});
    const tp::TensorParallel tpo{g.tp};
    const bool holds_embedding = g.first_stage() || g.last_stage();
    const int per_stage = kLayers / c.pp;
    {
      auto lock = test::seeded_draws(7);
      if (holds_embedding) embedding = tp::VocabParallelEmbedding(kPadded, kHidden, tpo);
      for (int l = g.pp_rank * per_stage; l < (g.pp_rank + 1) * per_stage; ++l) {
        up.emplace_back(kHidden, kFfn, tpo);
        down.emplace_back(kFfn, kHidden, tpo);
      }
    }
    ParamGroup group;
    if (holds_embedding) {
      at::Tensor padded = at::zeros({kPadded, kHidden});
      padded.narrow(0, 0, kVocab).copy_(w.at("embed.weight"));
      embedding->load_full(padded);
      tp::mark_split(embedding->weight, g.tp, 0, kVocab, kPadded);  // the padding is not exported
      mark_pipeline_shared(embedding->weight);
      group.params.push_back({"embed.weight", embedding->weight});
    }
    for (int k = 0; k < per_stage; ++k) {
      const int l = g.pp_rank * per_stage + k;
      const auto name = [l](const char* what) { return fmt::format("layer{}.{}", l, what); };
      up[k]->load_full(w.at(name("up.weight")), w.at(name("up.bias")));
      down[k]->load_full(w.at(name("down.weight")), w.at(name("down.bias")));
      group.params.push_back({name("up.weight"), up[k]->weight});
      group.params.push_back({name("up.bias"), up[k]->bias});
      group.params.push_back({name("down.weight"), down[k]->weight});
      group.params.push_back({name("down.bias"), down[k]->bias});
    }
    ZeroOptions zo;
    zo.stage = stage_from_int(c.stage);
    zo.bucket_bytes = 1 << 10;  // parameters split across buckets, and buckets across ranks
    zo.unit_policy.persist_below = 0;
    zo.timeout = std::chrono::seconds(60);
    zo.grid = g;
    opt = std::make_unique<DistributedOptimizer>(std::vector<ParamGroup>{group}, AdamW(0.01), g.dp, zo);
    for (const auto& p : group.params) tensors.insert(p.name, p.tensor);
    if (g.last_stage()) {  // a buffer: whole on every rank, no optimizer's
      scale = w.at("scale").clone();
      tensors.insert("scale", scale);
    }
  }
};

HfExportOptions options_with_aliases() {
  HfExportOptions o;
  o.names["embed.weight"] = {"embed.weight", "decoder.weight"};  // a tied copy
  return o;
}

// Every file of `dir` read back: name -> (file, tensor).
std::map<std::string, std::pair<std::string, at::Tensor>> read_export(const std::string& dir) {
  std::map<std::string, std::pair<std::string, at::Tensor>> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") continue;
    const auto f = safetensors::read(e.path().string());
    for (const auto& x : f.entries) {
      EXPECT_EQ(x.dtype, "F32") << x.name;
      at::Tensor t = at::empty(x.shape, at::kFloat);
      if (x.nbytes > 0) std::memcpy(t.data_ptr(), f.bytes(x), x.nbytes);
      EXPECT_EQ(out.count(x.name), 0u) << x.name << " twice";
      out[x.name] = {e.path().filename().string(), t};
    }
  }
  return out;
}

std::vector<Case> cases_for(int n) {
  switch (n) {
    case 1: return {{1, 1, 3}, {1, 1, 0}};
    case 2: return {{2, 1, 3}, {1, 2, 2}, {1, 1, 3}};
    case 3: return {{1, 3, 1}, {1, 1, 3}};
    default: return {{2, 2, 3}, {1, 2, 3}, {2, 1, 3}, {4, 1, 0}, {1, 4, 1}};
  }
}

DIST_TEST(HfExport, EveryLayoutWritesTheUnsplitValues) {
  const auto w = whole_values();
  const int n = test::world()->size();
  if (n > 4) GTEST_SKIP() << "cases for 1-4 ranks";
  const std::string base = test::shared_dir("hf_export");
  for (const auto& c : cases_for(n)) {
    SCOPED_TRACE(fmt::format("t={} p={} stage {}", c.tp, c.pp, c.stage));
    Part part(c, w);
    const std::string dir = base + fmt::format("/t{}p{}s{}", c.tp, c.pp, c.stage);
    HfExportOptions o = options_with_aliases();
    o.max_shard_bytes = 3000;  // several files per stage
    const auto report = export_hf_safetensors(dir, part.tensors, part.g, part.opt.get(), o);
    if (test::world()->rank() == 0) {
      const auto got = read_export(dir);
      auto want = w;
      want["decoder.weight"] = w.at("embed.weight");
      EXPECT_EQ(got.size(), want.size());  // no ASSERT on one rank: the others go on to collectives
      for (const auto& [name, t] : want) {
        if (got.count(name) != 1) {
          ADD_FAILURE() << name << " is not in the export";
          continue;
        }
        EXPECT_TRUE(at::equal(got.at(name).second, t)) << name;
      }
      // The index names each tensor's file; the files are model-k-of-n.
      std::ifstream in(dir + "/model.safetensors.index.json");
      const auto index = nlohmann::json::parse(in);
      std::set<std::string> files;
      int64_t total = 0;
      for (const auto& [name, entry] : got) {
        EXPECT_EQ(index["weight_map"].value(name, ""), entry.first) << name;
        files.insert(entry.first);
        total += entry.second.numel() * 4;
      }
      EXPECT_EQ(index["weight_map"].size(), got.size());
      EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), total);
      EXPECT_EQ(report.total_bytes, total);
      EXPECT_GE(files.size(), static_cast<size_t>(c.pp));
      int k = 1;
      for (const auto& f : files) {
        EXPECT_EQ(f, fmt::format("model-{:05d}-of-{:05d}.safetensors", k++, files.size()));
      }
      EXPECT_EQ(report.files.size(), files.size() + 1);
      EXPECT_EQ(report.largest_tensor_bytes, kVocab * kHidden * 4);
      EXPECT_EQ(report.largest_buffer_bytes, kPadded * kHidden * 4);  // the padded rank chunks
    }
  }
}

DIST_TEST(HfExport, OneFileWithoutIndexAndAtomicReplacement) {
  const auto w = whole_values();
  const int n = test::world()->size();
  if (n > 4) GTEST_SKIP() << "cases for 1-4 ranks";
  const Case c{1, 1, n > 1 ? 3 : 0};
  Part part(c, w);
  const std::string dir = test::shared_dir("hf_export_one") + "/hf";
  HfExportOptions o = options_with_aliases();
  o.write_extra = [](const std::string& d) { std::ofstream(d + "/config.json") << "{}\n"; };
  auto report = export_hf_safetensors(dir, part.tensors, part.g, part.opt.get(), o);
  EXPECT_EQ(report.files, std::vector<std::string>{"model.safetensors"});
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors") && fs::exists(dir + "/config.json"));
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors.index.json"));
  // A failure on the last rank after every file is written: every rank throws, the earlier
  // export stays as it was (no index appears, config.json is the first one's) and no temporary
  // directory is left.
  HfExportOptions failing = options_with_aliases();
  failing.max_shard_bytes = 3000;
  failing.after_files_written = [n](int rank) {
    if (rank == n - 1) throw std::runtime_error("injected");
  };
  std::string message;
  try {
    export_hf_safetensors(dir, part.tensors, part.g, part.opt.get(), failing);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("injected"), std::string::npos) << message;
  if (test::world()->rank() != n - 1) {  // the others say what the failure leaves
    EXPECT_NE(message.find("is unchanged"), std::string::npos) << message;
  }
  // Rank 0 removed the temporary directory (and makes the next export's): it checks.
  if (test::world()->rank() == 0) {
    EXPECT_TRUE(fs::exists(dir + "/model.safetensors") && fs::exists(dir + "/config.json"));
    EXPECT_FALSE(fs::exists(dir + "/model.safetensors.index.json"));
    EXPECT_FALSE(fs::exists(fs::path(dir).parent_path() / ".hf.export-tmp"));
  }
  // The same directory again, sharded this time: replaced whole (the single file is gone).
  HfExportOptions sharded = options_with_aliases();
  sharded.max_shard_bytes = 3000;
  report = export_hf_safetensors(dir, part.tensors, part.g, part.opt.get(), sharded);
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/config.json"));
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors.index.json"));
  EXPECT_GT(report.files.size(), 2u);
  // A directory holding what no export writes is refused on every rank.
  test::all_ranks(true);
  if (test::world()->rank() == 0) fs::create_directories(dir + "/keep-me");
  test::all_ranks(true);
  message.clear();
  try {
    export_hf_safetensors(dir, part.tensors, part.g, part.opt.get(), o);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("holds 'keep-me', which no export writes"), std::string::npos) << message;
  EXPECT_TRUE(fs::exists(dir + "/keep-me"));
}

}  // namespace
}  // namespace shardopt
