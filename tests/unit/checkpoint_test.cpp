// Checkpoints in one process (size-1 communicator): bitwise resume for every stage and rule, the
// manifest, consolidation read back with pickle_load, full state dicts, every documented error,
// the simulated crash, and the resharding index maths for many world sizes.
#include "shardopt/checkpoint.hpp"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/optim/sgd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <unistd.h>

#include "checkpoint/element_sums.hpp"
#include "checkpoint/files.hpp"
#include "shardopt/detail/shard_plan.hpp"
#include "shardopt/detail/state_sections.hpp"
#include "shardopt/error.hpp"
#include "support/checkpoint_model.hpp"
#include "support/expect_error.hpp"
#include "support/temp_dir.hpp"

namespace shardopt {
namespace {

namespace fs = std::filesystem;
using test::ckpt_rule;
using test::ckpt_train;
using test::CkptNet;

struct TempDir : test::TempDir {
  TempDir() : test::TempDir("shardopt-ckpt") {}
};

ZeroOptions zero(int stage) {
  ZeroOptions zo;
  zo.stage = stage_from_int(stage);
  zo.bucket_bytes = 64;  // several buckets: pieces split across them
  return zo;
}

// The setup most tests share: a fresh directory, one process and CkptNet.
class Checkpoint : public ::testing::Test {
 protected:
  // A native-rule optimizer over `net` at `stage`, trained `steps` steps.
  DistributedOptimizer& trained(const std::string& rule, int stage, int steps) {
    opt_ = std::make_unique<DistributedOptimizer>(net.groups(), ckpt_rule(rule), comm, zero(stage));
    ckpt_train(*opt_, net, 0, steps);
    return *opt_;
  }
  TempDir tmp;
  CommunicatorPtr comm = make_single_communicator();
  CkptNet net;

 private:
  std::unique_ptr<DistributedOptimizer> opt_;
};
class CheckpointErrors : public Checkpoint {
 protected:
  // A good checkpoint of two AdamW steps at tmp/ckpt (its directory returned).
  std::string saved() {
    trained("adamw", 2, 2).save_checkpoint(tmp / "ckpt");
    return tmp / "ckpt";
  }
};

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

using test::expect_error;

// ---- resume ---------------------------------------------------------------------------------

struct ResumeCase {
  int stage;
  std::string rule;
};

class CheckpointResume : public Checkpoint, public ::testing::WithParamInterface<ResumeCase> {};

// Train 3 steps, save, train 3 more; a fresh optimizer loading the checkpoint and training the
// same 3 steps must end bitwise equal (parameters, and the step count through bias correction).
TEST_P(CheckpointResume, ContinuesBitwise) {
  const auto& c = GetParam();
  auto& opt = trained(c.rule, c.stage, 3);
  opt.save_checkpoint(tmp / "ckpt");
  ckpt_train(opt, net, 3, 6);
  const auto expected = net.snapshot();

  CkptNet fresh;
  DistributedOptimizer resumed(fresh.groups(), ckpt_rule(c.rule), comm, zero(c.stage));
  for (auto& g : resumed.param_groups()) g.options().set_lr(123.0);  // restored from the file
  resumed.load_checkpoint(tmp / "ckpt");
  EXPECT_EQ(resumed.last_step().step, 3);
  EXPECT_DOUBLE_EQ(resumed.param_groups()[1].options().get_lr(), 0.02);
  ckpt_train(resumed, fresh, 3, 6);
  std::string worst;
  EXPECT_TRUE(test::ckpt_bitwise_equal(fresh.snapshot(), expected, &worst)) << worst;
  EXPECT_GT(test::ckpt_max_diff(expected, CkptNet().snapshot(), &worst), 1e-3);  // it trained
}

std::vector<ResumeCase> resume_cases() {
  std::vector<ResumeCase> out;
  for (int stage : {0, 1, 2}) {
    for (const char* rule : {"adamw", "adam", "sgd", "adagrad", "rmsprop", "lamb"}) {
      out.push_back({stage, rule});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Rules, CheckpointResume, ::testing::ValuesIn(resume_cases()),
                         [](const auto& info) {
                           return "stage" + std::to_string(info.param.stage) + "_" +
                                  info.param.rule;
                         });

// A checkpoint written at one stage resumes at another (same values; the format is uniform).
TEST_F(Checkpoint, ResumesAcrossStages) {
  auto& opt = trained("adamw", 2, 3);
  opt.save_checkpoint(tmp / "ckpt");
  ckpt_train(opt, net, 3, 6);
  const auto expected = net.snapshot();
  for (int stage : {0, 1}) {
    CkptNet fresh;
    ZeroOptions zo = zero(stage);
    zo.bucket_bytes = 1 << 20;  // other buckets than the writer's
    DistributedOptimizer resumed(fresh.groups(), ckpt_rule("adamw"), comm, zo);
    resumed.load_checkpoint(tmp / "ckpt");
    ckpt_train(resumed, fresh, 3, 6);
    std::string worst;
    EXPECT_LE(test::ckpt_max_diff(fresh.snapshot(), expected, &worst), 1e-6)
        << "stage " << stage << ", worst " << worst;
  }
}

// ---- manifest and trainer state --------------------------------------------------------------

TEST_F(Checkpoint, ManifestNamesEveryParameterAndFile) {
  auto& opt = trained("adamw", 2, 2);
  at::Tensor rng = at::arange(10, at::kByte);
  save_checkpoint(opt, tmp / "ckpt", {R"({"step": 2, "epoch": {"pos": 7}})", {{"rng", rng}}});

  const CheckpointInfo info = read_checkpoint_info(tmp / "ckpt");
  EXPECT_EQ(info.format_version, kCheckpointFormatVersion);
  EXPECT_EQ(info.world_size, 1);
  EXPECT_EQ(info.stage, 2);
  EXPECT_EQ(info.precision, "fp32");
  EXPECT_EQ(info.step, 2);
  EXPECT_EQ(info.rule, "adamw");
  EXPECT_EQ(info.state_names, (std::vector<std::string>{"exp_avg", "exp_avg_sq"}));
  std::map<std::string, std::vector<int64_t>> shapes;
  std::vector<std::string> names;
  for (const auto& p : info.params) {
    shapes[p.name] = p.shape;
    names.push_back(p.name);
  }
  // In the order the optimizer was given them (its groups' lists), not the flat layout's.
  EXPECT_EQ(names, (std::vector<std::string>{"embed.weight", "fc1.weight", "fc2.weight",
                                             "unused.weight", "fc1.bias", "fc2.bias",
                                             "tiny.bias"}));
  // Trainable, deduplicated parameters by name: the tied decoder and the frozen scale are not
  // the optimizer's.
  EXPECT_EQ(shapes.size(), 7u);
  EXPECT_EQ(shapes["embed.weight"], (std::vector<int64_t>{test::kCkptVocab, test::kCkptDim}));
  EXPECT_EQ(shapes["tiny.bias"], (std::vector<int64_t>{1}));
  EXPECT_EQ(shapes.count("decoder.weight"), 0u);
  EXPECT_EQ(shapes.count("frozen.scale"), 0u);

  const auto m = nlohmann::json::parse(info.manifest_json);
  EXPECT_TRUE(m.at("loss_scaler").is_null());
  EXPECT_EQ(m.at("optimizer").at("param_groups").size(), 2u);
  EXPECT_DOUBLE_EQ(m.at("optimizer").at("param_groups")[0].at("weight_decay").get<double>(), 0.05);
  EXPECT_DOUBLE_EQ(m.at("optimizer").at("param_groups")[1].at("lr").get<double>(), 0.02);
  ASSERT_EQ(m.at("files").size(), 1u);
  const auto& f = m.at("files")[0];
  EXPECT_EQ(f.at("path"), "shard-00000-of-00001.bin");
  EXPECT_EQ(f.at("bytes").get<int64_t>(),
            static_cast<int64_t>(fs::file_size(tmp / "ckpt/" + f.at("path").get<std::string>())));
  EXPECT_EQ(f.at("crc32c").get<std::string>().size(), 8u);
  for (const auto& p : m.at("parameters")) {
    int64_t covered = 0;
    for (const auto& piece : p.at("pieces")) covered += piece.at(3).get<int64_t>();
    EXPECT_EQ(covered, p.at("numel").get<int64_t>()) << p.at("name");
  }
  EXPECT_EQ(nlohmann::json::parse(info.trainer_json).at("epoch").at("pos"), 7);

  CkptNet fresh;
  DistributedOptimizer resumed(fresh.groups(), ckpt_rule("adamw"), comm, zero(1));
  const TrainerState t = load_checkpoint(resumed, tmp / "ckpt");
  EXPECT_EQ(nlohmann::json::parse(t.json).at("step"), 2);
  ASSERT_EQ(t.tensors.count("rng"), 1u);
  EXPECT_TRUE(t.tensors.at("rng").equal(rng));
}

TEST_F(Checkpoint, ReplacesThePreviousCheckpointAndLeavesNoTemporaries) {
  auto& opt = trained("sgd", 2, 1);
  opt.save_checkpoint(tmp / "ckpt/");  // a trailing slash names the same directory
  ckpt_train(opt, net, 1, 2);
  opt.save_checkpoint(tmp / "ckpt");
  EXPECT_EQ(read_checkpoint_info(tmp / "ckpt").step, 2);
  std::vector<std::string> entries;
  for (const auto& e : fs::directory_iterator(tmp / "")) entries.push_back(e.path().filename());
  EXPECT_EQ(entries, (std::vector<std::string>{"ckpt"}));
}

// ---- consolidation and full state dicts -------------------------------------------------------

// Saves `opt` into tmp/ckpt, then consolidates it into tmp/model.pt and tmp/optim.pt.
void save_and_consolidate(DistributedOptimizer& opt, const TempDir& tmp) {
  opt.save_checkpoint(tmp / "ckpt");
  ConsolidateOptions co;
  co.optimizer_state_out = tmp / "optim.pt";
  consolidate_checkpoint(tmp / "ckpt", tmp / "model.pt", co);
}

TEST_F(Checkpoint, ConsolidatedFileIsAPickledDictOfFullTensors) {
  auto& opt = trained("adamw", 2, 3);
  save_and_consolidate(opt, tmp);

  std::ifstream in(tmp / "model.pt", std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
  const c10::IValue v = torch::jit::pickle_load(bytes);
  ASSERT_TRUE(v.isGenericDict());
  const auto expected = net.snapshot();
  size_t n = 0;
  for (const auto& e : v.toGenericDict()) {
    const std::string name = e.key().toStringRef();
    ASSERT_TRUE(expected.count(name)) << name;
    EXPECT_TRUE(e.value().toTensor().equal(expected.at(name))) << name;
    ++n;
  }
  EXPECT_EQ(n, 7u);

  // The optimizer state: full exp_avg per parameter, equal to what read_full_state assembles.
  const FullState full = read_full_state(tmp / "ckpt", true);
  std::ifstream oin(tmp / "optim.pt", std::ios::binary);
  std::vector<char> obytes((std::istreambuf_iterator<char>(oin)), {});
  const auto top = torch::jit::pickle_load(obytes).toGenericDict();
  EXPECT_EQ(top.at("step").toInt(), 3);
  EXPECT_EQ(top.at("rule").toStringRef(), "adamw");
  const auto state = top.at("state").toGenericDict();
  const at::Tensor m = state.at("fc2.weight").toGenericDict().at("exp_avg").toTensor();
  EXPECT_TRUE(m.equal(full.optimizer_state.at("exp_avg")["fc2.weight"]));
  EXPECT_GT(m.abs().max().item<double>(), 0.0);
}

// Starting a sharded run from a full state (parameters + optimizer state) continues exactly like
// loading the sharded checkpoint; parameters alone set the weights.
TEST_F(Checkpoint, FullStateStartsAShardedRun) {
  auto& opt = trained("adamw", 2, 3);
  save_and_consolidate(opt, tmp);
  ckpt_train(opt, net, 3, 5);
  const auto expected = net.snapshot();

  for (int stage : {0, 1, 2}) {
    CkptNet fresh;
    DistributedOptimizer from_file(fresh.groups(), ckpt_rule("adamw"), comm, zero(stage));
    const auto unused = load_full_state_dict(from_file, tmp / "model.pt", tmp / "optim.pt");
    EXPECT_TRUE(unused.empty());
    EXPECT_EQ(from_file.last_step().step, 3);
    ckpt_train(from_file, fresh, 3, 5);
    std::string worst;
    EXPECT_LE(test::ckpt_max_diff(fresh.snapshot(), expected, &worst), 1e-6)
        << "stage " << stage << " " << worst;
  }

  // Parameters only, from a map with extra entries (a tied alias, a buffer): those are returned.
  CkptNet fresh;
  DistributedOptimizer params_only(fresh.groups(), ckpt_rule("adamw"), comm, zero(2));
  auto full = read_full_state(tmp / "ckpt").params;
  full.insert("decoder.weight", full["embed.weight"]);
  full.insert("bn.running_mean", at::zeros({3}));
  const auto unused = load_full_state_dict(params_only, full);
  EXPECT_EQ(unused, (std::vector<std::string>{"decoder.weight", "bn.running_mean"}));
  EXPECT_TRUE(fresh.by_name["fc1.weight"].equal(full["fc1.weight"]));
  EXPECT_TRUE(fresh.by_name["embed.weight"].equal(full["embed.weight"]));
  EXPECT_EQ(params_only.last_step().step, 0);
}

// ---- errors -----------------------------------------------------------------------------------

void load_into_fresh(const std::string& dir, const std::string& rule = "adamw", int64_t hidden = 7,
                     const std::string& fc1 = "fc1.weight") {
  CkptNet net(hidden, fc1);
  DistributedOptimizer opt(net.groups(), ckpt_rule(rule), make_single_communicator(), zero(2));
  opt.load_checkpoint(dir);
}

TEST_F(CheckpointErrors, MissingCheckpointOrShard) {
  const std::string dir = saved();
  expect_error([&] { load_into_fresh(tmp / "nowhere"); }, ErrorKind::Checkpoint,
               {"no checkpoint at", "manifest.json does not exist"});
  fs::remove(dir + "/shard-00000-of-00001.bin");
  expect_error([&] { load_into_fresh(dir); }, ErrorKind::Checkpoint,
               {"shard-00000-of-00001.bin", "is missing"});
}

TEST_F(CheckpointErrors, CorruptByteIsAChecksumMismatch) {
  const std::string dir = saved();
  const std::string shard = dir + "/shard-00000-of-00001.bin";
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(200);
    const char c = static_cast<char>(f.get() ^ 0x01);
    f.seekp(200);
    f.put(c);
  }
  expect_error([&] { load_into_fresh(dir); }, ErrorKind::Checkpoint,
               {"checksum mismatch", shard, "corrupt"});
  expect_error([&] { read_full_state(dir); }, ErrorKind::Checkpoint, {"checksum mismatch"});
}

TEST_F(CheckpointErrors, AnotherModelIsNamed) {
  const std::string dir = saved();
  // The first difference in layout order (reverse registration) is named.
  expect_error([&] { load_into_fresh(dir, "adamw", 8); }, ErrorKind::Mismatch,
               {"'fc2.weight'", "[8, 6] in the model but [7, 6] in the checkpoint"});
  expect_error([&] { load_into_fresh(dir, "adamw", 7, "fc1.kernel"); }, ErrorKind::Mismatch,
               {"'fc1.kernel'", "is not in it"});
  expect_error([&] { load_into_fresh(dir, "sgd"); }, ErrorKind::Mismatch,
               {"holds the state of adamw", "this optimizer runs sgd"});
}

TEST_F(CheckpointErrors, UnknownFormatVersionAndBadJson) {
  const std::string dir = saved();
  const std::string path = dir + "/manifest.json";
  auto m = nlohmann::json::parse(read_text(path));
  m["format_version"] = 99;
  std::ofstream(path) << m.dump();
  expect_error([&] { load_into_fresh(dir); }, ErrorKind::Checkpoint,
               {path, "unknown format version 99", "reads versions 1 to 3"});
  std::ofstream(path) << "{not json";
  expect_error([&] { load_into_fresh(dir); }, ErrorKind::Checkpoint, {path, "not valid JSON"});
}

// A manifest edit that keeps valid JSON (a piece's shard offset moved by one element) used to
// load silently wrong: the manifest's own checksum catches it, and without a checksum (manifests
// written before it existed) the piece tables are checked against the recorded layout.
TEST_F(CheckpointErrors, EditedManifestIsDetected) {
  const std::string dir = saved();
  const std::string path = dir + "/manifest.json";
  const auto original = nlohmann::json::parse(read_text(path));
  ASSERT_TRUE(original.contains("manifest_crc32"));
  auto edited = original;
  nlohmann::json* first = nullptr;  // the piece stored first: moving it by one stays in the file
  for (auto& p : edited["parameters"]) {
    if (!first || p["pieces"][0][1] < (*first)["pieces"][0][1]) first = &p;
  }
  ASSERT_NE(first, nullptr);
  const std::string name = (*first)["name"].get<std::string>();
  (*first)["pieces"][0][1] = (*first)["pieces"][0][1].get<int64_t>() + 1;
  std::ofstream(path) << edited.dump(1);
  expect_error([&] { load_into_fresh(dir); }, ErrorKind::Checkpoint,
               {path, "checksum mismatch in manifest"});
  edited.erase("manifest_crc32");
  std::ofstream(path) << edited.dump(1);
  expect_error([&] { load_into_fresh(dir); }, ErrorKind::Checkpoint,
               {"the piece table of parameter '" + name + "' does not match the layout"});
  auto unsigned_original = original;  // an older manifest, unedited: still loads
  unsigned_original.erase("manifest_crc32");
  std::ofstream(path) << unsigned_original.dump(1);
  load_into_fresh(dir);
}

// A parameter gone NaN is refused by the save itself, naming it; the last good checkpoint stays.
TEST_F(CheckpointErrors, NonFiniteValuesAreNeverSaved) {
  const std::string dir = saved();
  const std::string before = read_text(dir + "/manifest.json");
  CkptNet other;
  DistributedOptimizer opt(other.groups(), ckpt_rule("adamw"), comm, zero(1));
  ckpt_train(opt, other, 0, 1);
  {
    at::NoGradGuard no_grad;
    for (auto& [name, t] : other.named) {
      if (name == "fc2.bias") t.fill_(std::nanf(""));  // fp32: the model is the master
    }
  }
  expect_error([&] { opt.save_checkpoint(dir); }, ErrorKind::NonFinite,
               {"parameter 'fc2.bias' holds NaN/Inf", "refusing to save"});
  EXPECT_EQ(read_text(dir + "/manifest.json"), before);
  load_into_fresh(dir);
}

TEST_F(CheckpointErrors, UnwritableOrForeignDirectory) {
  std::ofstream(tmp / "file") << "x";
  auto& opt = trained("adamw", 2, 0);
  expect_error([&] { opt.save_checkpoint(tmp / "file/ckpt"); }, ErrorKind::Checkpoint,
               {"cannot create directory", tmp / "file"});
  expect_error([&] { opt.save_checkpoint("/proc/shardopt-ckpt"); }, ErrorKind::Checkpoint,
               {"/proc"});
  fs::create_directories(tmp / "results");
  std::ofstream(tmp / "results/keep.txt") << "precious";
  expect_error([&] { opt.save_checkpoint(tmp / "results"); }, ErrorKind::Checkpoint,
               {"is not a shardopt checkpoint", "refusing to replace it"});
  EXPECT_TRUE(fs::exists(tmp / "results/keep.txt"));
}

TEST_F(CheckpointErrors, FactoryOptimizersAndBadTrainerStateAreRefused) {
  std::vector<ParamGroup> groups(1);
  for (auto& [name, t] : net.named) groups[0].params.push_back({name, t});
  DistributedOptimizer opt(
      groups,
      [](std::vector<at::Tensor> shard) {
        return std::make_unique<torch::optim::SGD>(shard, torch::optim::SGDOptions(0.1));
      },
      make_single_communicator(), zero(2));
  expect_error([&] { opt.save_checkpoint(tmp / "ckpt"); }, ErrorKind::Unsupported,
               {"ShardOptimizerFactory"});
  CkptNet net2;
  DistributedOptimizer native(net2.groups(), ckpt_rule("adamw"), make_single_communicator(),
                              zero(2));
  expect_error(
      [&] {
        save_checkpoint(native, tmp / "ckpt", {"[1, 2]", {}});
      },
      ErrorKind::InvalidArgument, {"must be a JSON object"});
  EXPECT_FALSE(fs::exists(tmp / "ckpt"));
}

// A save that dies after a shard was written leaves the previous checkpoint complete; the
// partial one is never visible, and the next save cleans it up.
TEST_F(CheckpointErrors, CrashDuringSaveKeepsThePreviousCheckpoint) {
  auto& opt = trained("adamw", 2, 2);
  opt.save_checkpoint(tmp / "ckpt");
  const auto at_two = net.snapshot();
  ckpt_train(opt, net, 2, 4);
  SaveOptions crash;
  crash.simulate_crash_after_shard_on_rank = 0;
  expect_error([&] { save_checkpoint(opt, tmp / "ckpt", {}, crash); }, ErrorKind::Checkpoint,
               {"simulated crash on rank 0"});
  EXPECT_TRUE(fs::exists(tmp / ".ckpt.tmp/shard-00000-of-00001.bin"));  // the partial save
  EXPECT_FALSE(fs::exists(tmp / ".ckpt.tmp/manifest.json"));
  EXPECT_EQ(read_checkpoint_info(tmp / "ckpt").step, 2);
  CkptNet fresh;
  DistributedOptimizer resumed(fresh.groups(), ckpt_rule("adamw"), comm, zero(2));
  resumed.load_checkpoint(tmp / "ckpt");
  std::string worst;
  EXPECT_TRUE(test::ckpt_bitwise_equal(fresh.snapshot(), at_two, &worst)) << worst;
  opt.save_checkpoint(tmp / "ckpt");
  EXPECT_EQ(read_checkpoint_info(tmp / "ckpt").step, 4);
  EXPECT_FALSE(fs::exists(tmp / ".ckpt.tmp"));
}

// ---- resharding index maths --------------------------------------------------------------------

// Random layouts saved at world A and loaded at world B: every owned element of every rank is
// filled exactly once from the element that holds the same parameter element.
TEST(ShardPlan, EveryElementComesFromWhereItWasSaved) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 9);
    std::vector<int64_t> numels;
    std::vector<int> groups;
    for (int i = 0; i < n; ++i) {
      numels.push_back(static_cast<int64_t>(rng() % 40));
      groups.push_back(i < n / 2 ? 0 : 1);
    }
    const int a = 1 + static_cast<int>(rng() % 5), b = 1 + static_cast<int>(rng() % 5);
    const auto saved = detail::make_layout(numels, groups, a, 1 + rng() % 4, 1 + rng() % 60);
    const auto loaded = detail::make_layout(numels, groups, b, 1 + rng() % 4, 1 + rng() % 60);
    // "Files": element value = param index * 1000 + element index, at the saved positions.
    std::vector<std::vector<int64_t>> files(a, std::vector<int64_t>(saved.shard_numel, -1));
    for (int i = 0; i < n; ++i) {
      const auto pieces = detail::saved_pieces(saved, i, a);
      ASSERT_TRUE(detail::covers(pieces, numels[i]));
      for (const auto& p : pieces) {
        for (int64_t e = 0; e < p.numel; ++e)
          files[p.rank][p.shard_begin + e] = i * 1000 + p.param_begin + e;
      }
    }
    for (int r = 0; r < b; ++r) {
      std::vector<int64_t> shard(loaded.shard_numel, -1);
      for (int i = 0; i < n; ++i) {
        for (const auto& op :
             detail::plan_copies(loaded, r, i, detail::saved_pieces(saved, i, a))) {
          for (int64_t e = 0; e < op.numel; ++e) {
            ASSERT_EQ(shard[op.dst + e], -1) << "filled twice";
            shard[op.dst + e] = files[op.src_rank][op.src + e];
          }
        }
      }
      // Compare with where the loaded layout puts each parameter element.
      for (size_t bk = 0; bk < loaded.buckets.size(); ++bk) {
        const auto& bl = loaded.buckets[bk];
        for (int64_t pos = r * bl.shard; pos < (r + 1) * bl.shard; ++pos) {
          int64_t want = -1;
          for (int k : bl.pieces) {
            const auto& piece = loaded.pieces[k];
            if (pos >= piece.offset && pos < piece.offset + piece.numel)
              want = piece.param * 1000 + piece.param_offset + pos - piece.offset;
          }
          ASSERT_EQ(shard[bl.shard_offset + pos - r * bl.shard], want)
              << "trial " << trial << " world " << a << " -> " << b << " rank " << r;
        }
      }
    }
  }
}

// Note [Quantised state in checkpoints]: random block-aligned layouts (block 4, parameters under
// 20 elements "small") saved at world A and loaded at world B: every entry of a block section
// (one per 4 elements) and of a packed section (small parameters' elements only) is filled from
// the entry of the same parameter block or element, and a packed section holds exactly the small
// parameters' elements.
TEST(StateSections, BlocksAndPackedEntriesFollowTheParameter) {
  std::mt19937 rng(11);
  const int64_t block = 4;
  const detail::SectionIndex blocks{block, false, 0, false}, packed{1, true, 20, false};
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 8);
    std::vector<int64_t> numels;
    std::vector<int> groups;
    for (int i = 0; i < n; ++i) {
      numels.push_back(1 + static_cast<int64_t>(rng() % 40));
      groups.push_back(i < n / 2 ? 0 : 1);
    }
    const int a = 1 + static_cast<int>(rng() % 4), b = 1 + static_cast<int>(rng() % 4);
    const auto saved =
        detail::make_layout(numels, groups, a, block * (1 + rng() % 3), 1 + rng() % 60, {}, block);
    const auto loaded =
        detail::make_layout(numels, groups, b, block * (1 + rng() % 3), 1 + rng() % 60, {}, block);
    for (const auto& ix : {blocks, packed}) {
      // Entry keys: param * 1000 + block (or element) index; -1 where none.
      auto key_of = [&](int i, int64_t param_element) {
        return i * 1000 + (ix.packed ? param_element : param_element / block);
      };
      std::vector<detail::SectionMap> from;
      std::vector<std::vector<int64_t>> files;
      for (int r = 0; r < a; ++r) {
        from.emplace_back(ix, saved.shard_numel, detail::held_pieces(saved, r, a));
        files.emplace_back(from.back().size(), -1);
      }
      int64_t small_total = 0;
      for (int i = 0; i < n; ++i) {
        if (ix.small(numels[i])) small_total += numels[i];
        for (const auto& p : detail::saved_pieces(saved, i, a)) {
          ASSERT_TRUE(detail::block_aligned(p, block));
          const auto [entry, count] = from[p.rank].entries(p.shard_begin, p.numel, numels[i]);
          for (int64_t e = 0; e < count; ++e) {
            files[p.rank][entry + e] = key_of(i, p.param_begin + e * (ix.packed ? 1 : block));
          }
        }
      }
      if (ix.packed) {
        int64_t sizes = 0;
        for (const auto& m : from) sizes += m.size();
        ASSERT_EQ(sizes, small_total);
      }
      for (int r = 0; r < b; ++r) {
        const detail::SectionMap to(ix, loaded.shard_numel, detail::held_pieces(loaded, r, b));
        std::vector<int64_t> shard(to.size(), -1);
        for (int i = 0; i < n; ++i) {
          for (const auto& op :
               detail::plan_copies(loaded, r, i, detail::saved_pieces(saved, i, a))) {
            const auto [src, count] = from[op.src_rank].entries(op.src, op.numel, numels[i]);
            const auto [dst, count2] = to.entries(op.dst, op.numel, numels[i]);
            ASSERT_EQ(count, count2);
            for (int64_t e = 0; e < count; ++e) shard[dst + e] = files[op.src_rank][src + e];
          }
        }
        for (int i = 0; i < n; ++i) {
          for (const auto& p : detail::saved_pieces(loaded, i, b)) {
            if (p.rank != r) continue;
            const auto [entry, count] = to.entries(p.shard_begin, p.numel, numels[i]);
            for (int64_t e = 0; e < count; ++e) {
              ASSERT_EQ(shard[entry + e], key_of(i, p.param_begin + e * (ix.packed ? 1 : block)))
                  << "trial " << trial << " world " << a << " -> " << b << " rank " << r;
            }
          }
        }
      }
    }
  }
}

// ---- fixtures for the Python round trip (tests/CMakeLists.txt runs these in order) -----------

// Writes $SHARDOPT_CKPT_FIXTURE/ckpt (2 steps of AdamW) and expected.json with every value.
TEST(CheckpointFixture, WriteForPython) {
  const char* dir = std::getenv("SHARDOPT_CKPT_FIXTURE");
  if (!dir) GTEST_SKIP() << "SHARDOPT_CKPT_FIXTURE is not set (the ctest fixture sets it)";
  fs::remove_all(dir);
  fs::create_directories(dir);
  CkptNet net;
  DistributedOptimizer opt(net.groups(), ckpt_rule("adamw"), make_single_communicator(), zero(2));
  ckpt_train(opt, net, 0, 2);
  opt.save_checkpoint(std::string(dir) + "/ckpt");
  nlohmann::json expected;
  for (const auto& item : read_full_state(std::string(dir) + "/ckpt").params) {
    const at::Tensor flat = item.value().reshape({-1}).to(at::kDouble);
    expected[item.key()] = {
        {"shape", item.value().sizes().vec()},
        {"values",
         std::vector<double>(flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel())}};
  }
  std::ofstream(std::string(dir) + "/expected.json") << expected.dump();
}

// Reads back what the Python test saved ($SHARDOPT_CKPT_FIXTURE/from_python.pt: every value + 1)
// into a sharded run.
TEST(CheckpointFixture, LoadFromPython) {
  const char* dir = std::getenv("SHARDOPT_CKPT_FIXTURE");
  if (!dir) GTEST_SKIP() << "SHARDOPT_CKPT_FIXTURE is not set (the ctest fixture sets it)";
  CkptNet net;
  DistributedOptimizer opt(net.groups(), ckpt_rule("adamw"), make_single_communicator(), zero(2));
  const auto unused = load_full_state_dict(opt, std::string(dir) + "/from_python.pt");
  EXPECT_EQ(unused, (std::vector<std::string>{"extra.buffer"}));
  const auto saved = read_full_state(std::string(dir) + "/ckpt").params;
  for (const auto& item : saved) {
    EXPECT_TRUE(net.by_name[item.key()].equal(item.value() + 1)) << item.key();
  }
}

// Note [No std::filesystem::remove_all]: the nftw-based removal that checkpoints use removes a
// whole tree, leaves what a symbolic link points to, and takes a missing path as already removed.
TEST(RemoveTree, RemovesATreeButNotWhatALinkPointsTo) {
  TempDir outside, dir;
  const fs::path kept = outside.path() / "kept.txt";
  std::ofstream(kept) << "stays";
  fs::create_directories(dir.path() / "a" / "b");
  std::ofstream(dir.path() / "a" / "b" / "f.bin") << "x";
  std::ofstream(dir.path() / "top.txt") << "y";
  fs::create_symlink(outside.path(), dir.path() / "a" / "link");
  std::error_code ec;
  detail::remove_tree(dir.path(), ec);
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_FALSE(fs::exists(dir.path()));
  EXPECT_TRUE(fs::exists(kept));
  detail::remove_tree(dir.path(), ec);
  EXPECT_FALSE(ec) << "a missing path: " << ec.message();
}

// Note [Element checksums]: the vectorised loop over consecutive 4-byte elements sums what the
// element-by-element hash sums, whatever the start and the tail, for either hash.
TEST(ElementSums, VectorisedLoopEqualsTheHashOfEachElement) {
  std::vector<uint32_t> bits(1000);
  std::mt19937 gen(3);
  for (auto& b : bits) b = static_cast<uint32_t>(gen());
  for (const auto hash : {detail::ElementHash::Mix64, detail::ElementHash::Multiply}) {
    for (const uint64_t begin : {uint64_t{0}, uint64_t{5}, uint64_t{1} << 40, ~uint64_t{0} - 20}) {
      for (const int64_t numel : {0, 1, 7, 8, 9, 63, 1000}) {
        uint64_t expected = 0;
        for (int64_t j = 0; j < numel; ++j) {
          expected += detail::element_hash(hash, begin + static_cast<uint64_t>(j), bits[j]);
        }
        EXPECT_EQ(detail::consecutive_element_sum_u32(
                      hash, begin, numel, reinterpret_cast<const unsigned char*>(bits.data())),
                  expected)
            << "begin " << begin << ", " << numel << " elements";
      }
    }
  }
}

// ElementHash::Multiply catches any single changed element outright (its multiplier is odd), and a
// swap of two elements or an element read at the index next to its own, here every time.
TEST(ElementSums, MultiplyHashCatchesChangedMovedAndSwappedElements) {
  using detail::multiply_hash;
  std::mt19937_64 gen(5);
  for (int trial = 0; trial < 20000; ++trial) {
    const uint64_t i = gen() >> (trial % 64), x = gen() >> (trial % 33);
    const uint64_t flipped = x ^ (uint64_t{1} << (trial % 64));
    EXPECT_NE(multiply_hash(i, x), multiply_hash(i, flipped)) << i << " " << x;
    const uint64_t j = i + 1 + gen() % 1000, y = gen() >> (trial % 33);
    if (x != y) {
      EXPECT_NE(multiply_hash(i, x) + multiply_hash(j, y),
                multiply_hash(i, y) + multiply_hash(j, x))
          << "swap " << i << " " << j;
    }
    EXPECT_NE(multiply_hash(i, x), multiply_hash(i + 1, x)) << "moved " << i;
  }
}

// Note [Direct shard writes]: through O_DIRECT's page-aligned staging buffer or the page cache,
// the same bytes, length and checksums; where the filesystem refuses O_DIRECT (tmpfs), the page
// cache.
TEST(FileWriter, DirectAndBufferedWriteTheSameFile) {
  TempDir dir;
  std::vector<unsigned char> bytes(detail::kDirectStaging * 2 + 12345);
  std::mt19937 gen(7);
  for (auto& b : bytes) b = static_cast<unsigned char>(gen());
  // Odd pieces, so that writes straddle the staging buffer and the CRC blocks.
  const std::vector<size_t> pieces{1, 4095, 4097, detail::kDirectStaging - 3, 100000};
  const auto write = [&](const fs::path& path, bool direct) {
    detail::FileWriter w(path, direct);
    size_t at = 0;
    for (size_t k = 0; at < bytes.size(); ++k) {
      const size_t take = std::min(pieces[k % pieces.size()], bytes.size() - at);
      w.write(bytes.data() + at, take);
      at += take;
    }
    w.sync_and_close();
    return std::make_tuple(w.direct(), w.crc(), w.block_crcs());
  };
  const auto read = [](const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::vector<unsigned char>(std::istreambuf_iterator<char>(in), {});
  };
  const auto buffered = write(dir.path() / "buffered.bin", false);
  EXPECT_FALSE(std::get<0>(buffered));
  std::vector<fs::path> places{dir.path()};
  if (fs::is_directory("/dev/shm")) places.push_back("/dev/shm");
  for (const fs::path& place : places) {
    const fs::path path = place / fmt::format("shardopt-direct-{}.bin", ::getpid());
    const auto direct = write(path, true);
    EXPECT_EQ(std::get<1>(direct), std::get<1>(buffered)) << place;
    EXPECT_EQ(std::get<2>(direct), std::get<2>(buffered)) << place;
    EXPECT_EQ(read(path), bytes) << place << (std::get<0>(direct) ? " (O_DIRECT)" : "");
    std::error_code ec;
    fs::remove(path, ec);
  }
  EXPECT_EQ(read(dir.path() / "buffered.bin"), bytes);
}

}  // namespace
}  // namespace shardopt
