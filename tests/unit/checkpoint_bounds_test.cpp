// Resource bounds of the checkpoint reader (Note [Sizes from files] in src/checkpoint/format.hpp):
// a manifest claiming 10^15 elements, a negative or overflowing shape or offset, a section past
// the end of its file are each a named Error{Checkpoint} before any allocation larger than the
// files. The manifests are edited without their checksum, as manifests older than it are read.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "checkpoint/files.hpp"
#include "shardopt/checkpoint.hpp"
#include "shardopt/error.hpp"
#include "support/expect_error.hpp"

namespace shardopt {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::expect_error;

constexpr int64_t kHuge = 1000000000000000;  // 10^15 elements

class CheckpointBounds : public ::testing::Test {
 protected:
  CheckpointBounds() {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp ? tmp : "/tmp") + "/shardopt-bounds-XXXXXX";
    root_ = mkdtemp(templ.data());
    dir_ = (root_ / "ckpt").string();
    // One parameter in one bucket, one rank: the smallest manifest to edit consistently.
    torch::OrderedDict<std::string, at::Tensor> params;
    params.insert("w", at::arange(8, at::kFloat).set_requires_grad(true));
    ZeroOptions zo;
    zo.stage = stage_from_int(0);
    DistributedOptimizer opt(params, AdamW(0.1), make_single_communicator(), zo);
    opt.zero_grad();
    opt.backward((params["w"] * params["w"]).sum());
    opt.step();
    save_checkpoint(opt, dir_, {"{}", {{"rng", at::arange(4)}}});
    manifest_ = json::parse(std::ifstream(path()));
    manifest_.erase("manifest_crc32");
  }
  ~CheckpointBounds() override {
    std::error_code ec;
    detail::remove_tree(root_, ec);
  }
  std::string path() const { return dir_ + "/manifest.json"; }
  void write(const json& m) { std::ofstream(path()) << m.dump(1); }
  // Loads into a fresh optimizer whose parameter is zeros; returns that parameter.
  at::Tensor load() {
    torch::OrderedDict<std::string, at::Tensor> params;
    params.insert("w", at::zeros({8}).set_requires_grad(true));
    ZeroOptions zo;
    zo.stage = stage_from_int(0);
    DistributedOptimizer opt(params, AdamW(0.1), make_single_communicator(), zo);
    try {
      load_checkpoint(opt, dir_);
    } catch (...) {
      loaded_ = params["w"];
      throw;
    }
    return params["w"];
  }

  fs::path root_;
  std::string dir_;
  json manifest_;
  at::Tensor loaded_;  // the parameter of the last load() that threw
};

TEST_F(CheckpointBounds, TheUneditedManifestLoads) {
  write(manifest_);
  load();
  EXPECT_EQ(read_full_state(dir_).params["w"].numel(), 8);
}

// Every count agrees with every other, only the shard file is not that big: consolidation must
// not allocate 4 PB (three of them) before it looks at the file.
TEST_F(CheckpointBounds, AManifestClaimingPetabytesIsRefusedBeforeAllocating) {
  json m = manifest_;
  auto& p = m["parameters"][0];
  p["shape"] = {kHuge};
  p["numel"] = kHuge;
  p["pieces"] = json::array({json::array({0, 0, 0, kHuge})});
  auto& b = m["layout"]["buckets"][0];
  b["numel"] = kHuge, b["padded"] = kHuge, b["shard"] = kHuge;
  int64_t offset = 64;
  for (auto& s : m["files"][0]["sections"]) {
    s["offset"] = offset;
    if (s["name"].get<std::string>().rfind("trainer/", 0) == 0) {
      offset += 64;
      continue;
    }
    s["shape"] = {kHuge};
    offset += 4 * kHuge;
  }
  m["files"][0]["bytes"] = offset;
  write(m);
  const std::string shard = dir_ + "/shard-00000-of-00001.bin";
  expect_error([&] { read_full_state(dir_); }, ErrorKind::Checkpoint,
               {shard, "bytes, but the manifest says " + std::to_string(offset)});
  expect_error([&] { consolidate_checkpoint(dir_, (root_ / "model.pt").string()); },
               ErrorKind::Checkpoint, {shard, "but the manifest says"});
}

// A shard path must name a file inside the directory: ".." and "." pass a filename() check but
// are the parent and the directory itself (regress-shard-path-dotdot.json, issue 42).
TEST_F(CheckpointBounds, ShardPathsOutsideTheDirectoryAreRefused) {
  for (const std::string bad : {"..", ".", "", "../shard-00000-of-00001.bin"}) {
    json m = manifest_;
    m["files"][0]["path"] = bad;
    write(m);
    expect_error([&] { read_full_state(dir_); }, ErrorKind::Checkpoint,
                 {path(), "shard path '" + bad + "' must be a plain file name"});
  }
}

// A state section shorter than its file's "param" section: the pieces fit "param" but not it
// (regress-state-section-shorter.hex, issue 42's checkpoint_dir fuzzer: an escaping c10::Error).
TEST_F(CheckpointBounds, StateSectionsAsLongAsTheParamSection) {
  json m = manifest_;
  for (auto& s : m["files"][0]["sections"]) {
    if (s["name"] == "state/exp_avg") s["shape"] = {1};
  }
  write(m);
  expect_error([&] { read_full_state(dir_, true); }, ErrorKind::Checkpoint,
               {path(), "section 'state/exp_avg'", "has shape [1], its 'param' section"});
  expect_error([&] { load(); }, ErrorKind::Checkpoint, {"section 'state/exp_avg'"});
}

// Fields only the whole-checkpoint readers use (the fuzzer's manifest without "trainer" made
// read_checkpoint_info throw nlohmann's exception; regress-manifest-without-trainer.hex).
TEST_F(CheckpointBounds, TrainerAndModuleFieldsAreChecked) {
  json m = manifest_;
  m.erase("trainer");
  write(m);
  expect_error([&] { read_checkpoint_info(dir_); }, ErrorKind::Checkpoint,
               {path(), "has no \"trainer\""});
  m = manifest_;
  m["module"] = {{"tensors", 5}, {"aliases", json::object()}};
  write(m);
  expect_error([&] { read_full_state(dir_); }, ErrorKind::Checkpoint,
               {"malformed manifest", path()});
  m = manifest_;
  m["precision"] = 16;
  write(m);
  expect_error([&] { read_checkpoint_info(dir_); }, ErrorKind::Checkpoint,
               {"malformed manifest", path()});
}

TEST_F(CheckpointBounds, NegativeOrOverflowingShapesAreNamed) {
  json m = manifest_;
  for (auto& s : m["files"][0]["sections"]) {
    if (s["name"] == "trainer/rng") s["shape"] = {-4};
  }
  write(m);
  expect_error([&] { load(); }, ErrorKind::Checkpoint,
               {path(), "section 'trainer/rng'", "shape [-4] has a negative dimension"});
  m = manifest_;
  for (auto& s : m["files"][0]["sections"]) {
    if (s["name"] == "trainer/rng") s["shape"] = {int64_t{1} << 40, int64_t{1} << 40};
  }
  write(m);
  expect_error([&] { load(); }, ErrorKind::Checkpoint,
               {"section 'trainer/rng'", "more than 2^63 elements"});
  m = manifest_;
  m["parameters"][0]["shape"] = {-2, -4};
  write(m);
  expect_error([&] { read_full_state(dir_); }, ErrorKind::Checkpoint,
               {path(), "parameter 'w'", "negative dimension"});
}

TEST_F(CheckpointBounds, OffsetsOutsideTheFileAreNamed) {
  for (const int64_t offset : {int64_t{-64}, int64_t{3}, int64_t{1} << 62, int64_t{1} << 20}) {
    json m = manifest_;
    for (auto& s : m["files"][0]["sections"]) {
      if (s["name"] == "trainer/rng") {
        s["offset"] = offset;
        if (offset == int64_t{1} << 62) s["shape"] = {int64_t{1} << 60};  // the end overflows
      }
    }
    write(m);
    expect_error([&] { load(); }, ErrorKind::Checkpoint, {path(), "section 'trainer/rng'"});
  }
  json m = manifest_;
  m["parameters"][0]["pieces"][0][1] = std::numeric_limits<int64_t>::max();
  write(m);
  expect_error([&] { load(); }, ErrorKind::Checkpoint, {path(), "a piece of 'w'"});
}

// The loss scaler's fields are read as the rest of the manifest is (in-range JSON integers, finite
// numbers) and before any state changes: a bad value is a named error with the parameters left
// as they were (they were set first and read with nlohmann's value(), casting 1.5 and 2^40).
TEST_F(CheckpointBounds, LossScalerFieldsAreCheckedBeforeAnyStateChanges) {
  const json good = {{"scale", 65536.0}, {"good_steps", 3}, {"hysteresis_left", 2},
                     {"overflows", 1}};
  json m = manifest_;
  m["loss_scaler"] = good;  // an fp32 optimizer ignores a valid one
  write(m);
  EXPECT_FALSE(at::equal(load(), at::zeros({8})));  // the saved values arrived
  struct Case {
    const char* field;
    json value;
    const char* what;
  };
  const std::vector<Case> cases = {
      {"scale", "big", "expected a number, got \"big\""},
      {"scale", nullptr, "expected a number, got null"},
      {"scale", -2.0, "invalid loss scaler state (scale -2"},
      {"scale", 0, "the scale must be positive"},
      {"good_steps", 1.5, "expected an integer, got 1.5"},
      {"good_steps", -1, "invalid loss scaler state"},
      {"hysteresis_left", int64_t{1} << 40, "integer 1099511627776 out of range"},
      {"overflows", 1e300, "expected an integer"},
      {"overflows", -7, "overflows -7"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(c.field) + " = " + c.value.dump());
    m = manifest_;
    m["loss_scaler"] = good;
    m["loss_scaler"][c.field] = c.value;
    write(m);
    expect_error([&] { load(); }, ErrorKind::Checkpoint, {path(), c.what});
    ASSERT_TRUE(loaded_.defined());
    EXPECT_TRUE(at::equal(loaded_, at::zeros({8})));
  }
  m = manifest_;
  m["loss_scaler"] = good;
  m["loss_scaler"].erase("overflows");
  write(m);
  expect_error([&] { load(); }, ErrorKind::Checkpoint, {"malformed manifest", "overflows"});
  m["loss_scaler"] = "fp16";
  write(m);
  expect_error([&] { load(); }, ErrorKind::Checkpoint,
               {"\"loss_scaler\" should be an object or null, got \"fp16\""});
}

}  // namespace
}  // namespace shardopt
