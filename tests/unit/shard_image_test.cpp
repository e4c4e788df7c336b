// Shard files' CRC-32C (Notes [CRC-32C], [Block checksums]) and the asynchronous save's shard
// image (Note [Shard images]): the checksums of pieces and blocks, the image's one-pass copy,
// FileWriter's known blocks, the image writing exactly the synchronous save's files, version-1
// checkpoints (zlib's CRC-32) still loading, and a corrupted byte caught by either checksum.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "checkpoint/crc32c.hpp"
#include "checkpoint/element_sums.hpp"
#include "checkpoint/files.hpp"
#include "checkpoint/format.hpp"
#include "checkpoint/image_copy.hpp"
#include "shardopt/async_checkpoint.hpp"
#include "shardopt/checkpoint.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/error.hpp"
#include "support/expect_error.hpp"
#include "support/temp_dir.hpp"

namespace shardopt {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::expect_error;

std::vector<uint8_t> random_bytes(size_t n, unsigned seed) {
  std::vector<uint8_t> out(n);
  std::mt19937 gen(seed);
  for (auto& b : out) b = static_cast<uint8_t>(gen());
  return out;
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

struct TempDir : test::TempDir {
  TempDir() : test::TempDir("shardopt-image") {}
};

// The textbook bit-at-a-time CRC-32C, the reference for the fast paths.
uint32_t crc32c_reference(const uint8_t* p, size_t n) {
  uint32_t c = ~0u;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

TEST(Crc32c, PiecesBlocksAndShiftsAgreeWithTheReference) {
  const char* check = "123456789";
  EXPECT_EQ(detail::crc32c(check, 9), 0xE3069283u);  // the standard check value
  const auto bytes = random_bytes(70000, 3);
  for (const size_t n : {size_t{0}, size_t{1}, size_t{255}, size_t{256}, size_t{4096},
                         size_t{69999}}) {
    const uint32_t want = crc32c_reference(bytes.data(), n);
    EXPECT_EQ(detail::crc32c(bytes.data(), static_cast<int64_t>(n)), want) << n;
    for (const size_t cut : {size_t{0}, n / 3, n}) {  // A then B, by extending and by combining
      const uint32_t a = detail::crc32c(bytes.data(), static_cast<int64_t>(cut));
      const auto rest = static_cast<int64_t>(n - cut);
      EXPECT_EQ(detail::crc32c_extend(a, bytes.data() + cut, rest), want) << n << " at " << cut;
      EXPECT_EQ(detail::crc32c_combine(a, detail::crc32c(bytes.data() + cut, rest), rest), want);
      EXPECT_EQ(detail::Crc32cShift(rest).combine(a, detail::crc32c(bytes.data() + cut, rest)),
                want);
    }
  }
  // Blocks: checksummed alone, copied or not, to aligned (streamed) or unaligned memory.
  constexpr int64_t kB = 4096, kBlocks = 7;  // four at a time, then three one by one
  std::vector<uint8_t> out(kB * kBlocks + 64);
  for (const size_t shift : {size_t{0}, size_t{3}}) {
    uint8_t* dst = out.data() + (16 - reinterpret_cast<uintptr_t>(out.data()) % 16) % 16 + shift;
    std::vector<uint32_t> copied(kBlocks), alone(kBlocks);
    detail::crc32c_blocks(dst, bytes.data() + 5, kBlocks, kB, copied.data());
    detail::crc32c_blocks(nullptr, bytes.data() + 5, kBlocks, kB, alone.data());
    EXPECT_EQ(std::vector<uint8_t>(dst, dst + kB * kBlocks),
              std::vector<uint8_t>(bytes.begin() + 5, bytes.begin() + 5 + kB * kBlocks));
    for (int64_t b = 0; b < kBlocks; ++b) {
      const uint32_t want = crc32c_reference(bytes.data() + 5 + b * kB, kB);
      EXPECT_EQ(copied[static_cast<size_t>(b)], want) << "block " << b;
      EXPECT_EQ(alone[static_cast<size_t>(b)], want) << "block " << b;
    }
  }
}

// The image's one-pass copy (image_copy.hpp) gives what the separate passes give: the bytes, each
// block's CRC-32C, the sum of ElementHash::Multiply over consecutive indices (from 0 and from
// beyond 2^32), and a NaN or an infinity in any block, first or last, of four or one at a time.
TEST(ImageCopy, OnePassEqualsTheSeparatePasses) {
  constexpr int64_t kB = detail::kBlockBytes;
  const auto bytes = random_bytes(static_cast<size_t>(kB * 9 + 8), 5);
  void* raw = nullptr;
  ASSERT_EQ(::posix_memalign(&raw, 64, static_cast<size_t>(kB * 9)), 0);
  std::unique_ptr<uint8_t, decltype(&std::free)> image(static_cast<uint8_t*>(raw), &std::free);
  for (const int64_t blocks : {int64_t{1}, int64_t{3}, int64_t{4}, int64_t{9}}) {
    for (const uint64_t index : {uint64_t{0}, uint64_t{77}, (uint64_t{1} << 32) + 5}) {
      // Finite values from the random bits (exponent below all-ones), 4 bytes past alignment.
      std::vector<uint8_t> src(bytes.begin(), bytes.begin() + blocks * kB + 4);
      for (int64_t j = 0; j < blocks * kB / 4; ++j) src[static_cast<size_t>(4 * j + 7)] &= 0x3F;
      const uint8_t* from = src.data() + 4;
      std::vector<uint32_t> crcs(static_cast<size_t>(blocks));
      const detail::SummedCopy c = detail::copy_blocks_summed(image.get(), from, blocks,
                                                              crcs.data(), index);
      EXPECT_EQ(std::memcmp(image.get(), from, static_cast<size_t>(blocks * kB)), 0);
      for (int64_t b = 0; b < blocks; ++b) {
        EXPECT_EQ(crcs[static_cast<size_t>(b)], crc32c_reference(from + b * kB, kB)) << b;
      }
      uint64_t sum = 0;
      for (int64_t j = 0; j < blocks * kB / 4; ++j) {
        uint32_t x;
        std::memcpy(&x, from + 4 * j, 4);
        sum += detail::multiply_hash(index + static_cast<uint64_t>(j), x);
      }
      EXPECT_EQ(c.sum, sum) << blocks << " blocks from " << index;
      EXPECT_FALSE(c.non_finite);
      for (const float bad : {std::numeric_limits<float>::quiet_NaN(),
                              -std::numeric_limits<float>::infinity()}) {
        for (const int64_t at : {int64_t{0}, blocks * kB / 4 - 1}) {
          std::vector<uint8_t> with = src;
          std::memcpy(with.data() + 4 + 4 * at, &bad, 4);
          EXPECT_TRUE(detail::copy_blocks_summed(image.get(), with.data() + 4, blocks,
                                                 crcs.data(), index)
                          .non_finite)
              << blocks << " blocks, element " << at;
        }
      }
    }
  }
}

// FileWriter::write_blocks (Note [Shard images]): whole blocks with known checksums, from
// page-aligned memory (O_DIRECT straight from it) or not, between ordinary writes, give the file,
// length and checksums that write() gives; where O_DIRECT is refused (tmpfs), the page cache.
TEST(FileWriter, KnownBlocksWriteWhatWriteWrites) {
  TempDir dir;
  const int64_t kB = detail::kBlockBytes;
  const auto bytes = random_bytes(static_cast<size_t>(kB * 3 + kB * 2500 + 1234), 11);
  const auto plain = [&](const fs::path& path) {
    detail::FileWriter w(path);
    w.write(bytes.data(), bytes.size());
    w.sync_and_close();
    return std::make_pair(w.crc(), w.block_crcs());
  };
  // The middle 2500 blocks (10 MiB: more than the staging buffer) from page-aligned memory or not.
  void* raw = nullptr;
  ASSERT_EQ(::posix_memalign(&raw, 4096, static_cast<size_t>(kB * 2501)), 0);
  std::unique_ptr<uint8_t, decltype(&std::free)> buffer(static_cast<uint8_t*>(raw), &std::free);
  std::vector<uint32_t> crcs(2500);
  detail::crc32c_blocks(nullptr, bytes.data() + kB * 3, 2500, kB, crcs.data());
  const auto known = [&](const fs::path& path, bool direct, bool page_aligned) {
    uint8_t* from = buffer.get() + (page_aligned ? 0 : 16);
    std::memcpy(from, bytes.data() + kB * 3, static_cast<size_t>(kB * 2500));
    detail::FileWriter w(path, direct);
    w.write(bytes.data(), 1);  // odd pieces before: staged, then flushed by write_blocks
    w.write(bytes.data() + 1, static_cast<size_t>(kB * 3 - 1));
    w.write_blocks(from, static_cast<size_t>(kB * 2500), crcs.data());
    w.write(bytes.data() + kB * 2503, bytes.size() - static_cast<size_t>(kB * 2503));
    w.sync_and_close();
    return std::make_tuple(w.direct(), w.crc(), w.block_crcs());
  };
  const auto want = plain(dir.path() / "plain.bin");
  std::vector<fs::path> places{dir.path()};
  if (fs::is_directory("/dev/shm")) places.push_back("/dev/shm");
  const std::string expected(bytes.begin(), bytes.end());
  for (const fs::path& place : places) {
    for (const bool direct : {false, true}) {
      for (const bool page_aligned : {false, true}) {
        const fs::path path = place / fmt::format("shardopt-known-{}.bin", ::getpid());
        const auto got = known(path, direct, page_aligned);
        const std::string what = fmt::format("{} direct {} (granted {}) aligned {}",
                                             place.string(), direct, std::get<0>(got),
                                             page_aligned);
        EXPECT_EQ(std::get<1>(got), want.first) << what;
        EXPECT_EQ(std::get<2>(got), want.second) << what;
        EXPECT_TRUE(read_file(path) == expected) << what;
        std::error_code ec;
        fs::remove(path, ec);
      }
    }
  }
  EXPECT_EQ(want.first, detail::crc32c(bytes.data(), static_cast<int64_t>(bytes.size())));
}

// A model large enough for whole blocks and several copy chunks per section (274,637 elements).
struct BigNet {
  std::vector<at::Tensor> params;
  BigNet() {
    at::manual_seed(99);
    const std::vector<std::vector<int64_t>> shapes{{301, 457}, {3}, {1000, 137}, {77}};
    for (const auto& shape : shapes) {
      params.push_back(at::randn(shape).set_requires_grad(true));
    }
  }
  std::vector<ParamGroup> groups() {
    std::vector<ParamGroup> g(1);
    for (size_t i = 0; i < params.size(); ++i) {
      g[0].params.push_back({fmt::format("p{}", i), params[i]});
    }
    return g;
  }
};

std::unique_ptr<DistributedOptimizer> big_optimizer(BigNet& net, const ParallelGroups& g,
                                                    int stage, const Rule& rule) {
  ZeroOptions zo;
  zo.stage = stage_from_int(stage);
  zo.bucket_bytes = 600000;  // several buckets, a parameter split across two
  auto opt = std::make_unique<DistributedOptimizer>(net.groups(), rule, g.dp, zo);
  for (int s = 0; s < 2; ++s) {
    opt->zero_grad();
    at::Tensor loss = at::zeros({});
    for (size_t i = 0; i < net.params.size(); ++i) {
      loss = loss + (net.params[i] * net.params[i]).sum() * (0.1 * static_cast<double>(i + 1));
    }
    opt->backward(loss);
    opt->step();
  }
  return opt;
}

// The asynchronous save's image (Note [Shard images]), its block checksums and non-finite check
// computed by the snapshot's copy, writes the synchronous save's files byte for byte
// (manifests equal, every checksum and element sum included), at every stage and for a rule with
// three state buffers and one whose state is not element-wise (8-bit AdamW: codes, block maxima
// and packed moments, Note [Quantised state in checkpoints]), which the writer sums itself.
TEST(AsyncCheckpoint, ImageWritesTheSynchronousFiles) {
  TempDir dir;
  auto comm = make_single_communicator();
  const ParallelGroups g = make_parallel_groups(comm, ParallelLayout{1, 1, 1});
  const std::vector<Rule> rules{AdamW(0.01).weight_decay(0.05), Adam(0.01).amsgrad(true),
                                AdamW8bit(0.01)};
  for (const int stage : {0, 2, 3}) {
    for (size_t r = 0; r < rules.size(); ++r) {
      const Rule& rule = rules[r];
      BigNet net;
      auto opt = big_optimizer(net, g, stage, rule);
      const TrainerState trainer{R"({"step": 2})", {{"rng", at::arange(1000, at::kLong)}}};
      const std::string sync = dir / fmt::format("sync{}{}", stage, r);
      const std::string async = dir / fmt::format("async{}{}", stage, r);
      save_grid_checkpoint(*opt, g, sync, trainer);
      AsyncCheckpoint saver(*opt, g);
      saver.save_checkpoint_async(async, trainer);
      saver.wait();
      const fs::path a = committed_folder(sync), b = committed_folder(async);
      const json ma = json::parse(read_file(a / "manifest.json"));
      const json mb = json::parse(read_file(b / "manifest.json"));
      EXPECT_EQ(ma.at("format_version"), kCheckpointFormatVersion);
      EXPECT_TRUE(ma.at("files")[0].contains("crc32c"));
      EXPECT_EQ(ma, mb) << "stage " << stage;
      const std::string file = ma.at("files")[0].at("path").get<std::string>();
      EXPECT_GT(ma.at("files")[0].at("bytes").get<int64_t>(), 64 * detail::kBlockBytes);
      EXPECT_TRUE(read_file(a / file) == read_file(b / file)) << "stage " << stage;
      // And it loads, bitwise.
      BigNet fresh;
      auto other = big_optimizer(fresh, g, stage, rule);
      load_grid_checkpoint(*other, g, async);
      auto& x = detail::shard_access(*opt);
      auto& y = detail::shard_access(*other);
      for (size_t bk = 0; bk < x.layout().buckets.size(); ++bk) {
        EXPECT_TRUE(x.owned_param_slice(static_cast<int>(bk))
                        .equal(y.owned_param_slice(static_cast<int>(bk))));
      }
    }
  }
}

// A NaN in the state is refused by the image's check, naming the parameter, on the writer's
// wait(); the previous commit stays.
TEST(AsyncCheckpoint, ImageRefusesNonFiniteValues) {
  TempDir dir;
  auto comm = make_single_communicator();
  const ParallelGroups g = make_parallel_groups(comm, ParallelLayout{1, 1, 1});
  BigNet net;
  auto opt = big_optimizer(net, g, 2, AdamW(0.01));
  AsyncCheckpoint saver(*opt, g);
  saver.save_checkpoint_async(dir / "ckpt");
  saver.wait();
  auto& access = detail::shard_access(*opt);
  access.owned_state_slice(1, 0)[70000] = std::numeric_limits<float>::quiet_NaN();
  std::string name;  // the parameter holding element 70000 of bucket 0 (the only rank's)
  const auto& layout = access.layout();
  for (const auto& piece : layout.pieces) {
    if (piece.bucket == 0 && piece.offset <= 70000 && 70000 < piece.offset + piece.numel) {
      name = access.param_name(piece.param);
    }
  }
  ASSERT_FALSE(name.empty());
  saver.save_checkpoint_async(dir / "ckpt");
  expect_error([&] { saver.wait(); }, ErrorKind::NonFinite,
               {"state/exp_avg_sq of parameter '" + name + "'", "refusing to save non-finite"});
  EXPECT_EQ(read_grid_commit(dir / "ckpt").step, 2);
}

// zlib's CRC-32.
uint32_t crc32(const void* data, size_t n) {
  return detail::checksum_of(detail::ShardChecksum::Crc32, data, static_cast<int64_t>(n));
}

// The manifest's own checksum (Note [Manifest checksum]) after an edit.
void write_manifest(const fs::path& folder, json m) {
  m.erase("manifest_crc32");
  const std::string text = detail::dump(m);
  m["manifest_crc32"] = detail::crc_text(crc32(text.data(), text.size()));
  write_file(folder / "manifest.json", detail::dump(m, 1));
}

// Rewrites a version-3 checkpoint as version 2 wrote it (Note [Block tables]): each shard file
// ends with its last section (no padding, no block table), its manifest entry lists the blocks'
// CRC-32C as text, and the element sums hash with ElementHash::Mix64 (Note [Element checksums];
// unsplit parameters: the tests' own).
void as_version_2(const fs::path& folder) {
  json m = json::parse(read_file(folder / "manifest.json"));
  ASSERT_EQ(m.at("format_version"), 3);
  m["format_version"] = 2;
  std::vector<std::string> files;
  for (auto& f : m["files"]) {
    const fs::path path = folder / f.at("path").get<std::string>();
    std::string bytes = read_file(path);
    size_t end = 0;
    for (const auto& s : f.at("sections")) {
      int64_t numel = 1;
      for (const auto d : s.at("shape")) numel *= d.get<int64_t>();
      const auto dtype = detail::dtype_from_name(s.at("dtype").get<std::string>(), "test");
      const auto elem = static_cast<int64_t>(c10::elementSize(dtype));
      end = std::max(end, static_cast<size_t>(s.at("offset").get<int64_t>() + numel * elem));
    }
    ASSERT_LE(end, f.at("blocks").at("table_offset").get<size_t>());
    bytes.resize(end);
    const uint32_t version = 2;
    std::memcpy(bytes.data() + 8, &version, sizeof(version));  // the header's version field
    write_file(path, bytes);
    files.push_back(bytes);
    f["bytes"] = end;
    f["crc32c"] = detail::crc_text(detail::crc32c(bytes.data(), static_cast<int64_t>(end)));
    std::string blocks;
    for (size_t at = 0; at < end; at += detail::kBlockBytes) {
      const size_t n = std::min(end - at, static_cast<size_t>(detail::kBlockBytes));
      blocks += detail::crc_text(detail::crc32c(bytes.data() + at, static_cast<int64_t>(n)));
    }
    f["blocks"] = {{"bytes", detail::kBlockBytes}, {"crc32c", blocks}};
  }
  std::vector<std::string> sections{"param"};
  for (const auto& n : m.at("optimizer").at("state")) {
    sections.push_back("state/" + n.get<std::string>());
  }
  for (auto& p : m["parameters"]) {
    if (!p.contains("sums")) continue;
    ASSERT_TRUE(p.at("split").is_null()) << "a split parameter's sums are not recomputed here";
    std::vector<uint64_t> sums(sections.size(), 0);
    for (const auto& piece : p.at("pieces")) {
      const auto rank = piece.at(0).get<size_t>();
      const auto shard_begin = piece.at(1).get<int64_t>();
      const auto param_begin = piece.at(2).get<int64_t>(), numel = piece.at(3).get<int64_t>();
      for (size_t k = 0; k < sections.size(); ++k) {
        for (const auto& sec : m["files"][rank].at("sections")) {
          if (sec.at("name") != sections[k]) continue;
          const int elem = static_cast<int>(c10::elementSize(
              detail::dtype_from_name(sec.at("dtype").get<std::string>(), "test")));
          const char* data =
              files[rank].data() + sec.at("offset").get<int64_t>() + shard_begin * elem;
          sums[k] += detail::element_sum(detail::ElementHash::Mix64, detail::TensorPlacement{},
                                         param_begin, numel, data, elem)
                         .sum;
        }
      }
    }
    json hex = json::array();
    for (const uint64_t v : sums) hex.push_back(fmt::format("{:016x}", v));
    p["sums"] = hex;
  }
  write_manifest(folder, m);
}

// Rewrites a version-2 checkpoint's manifest as version 1 wrote it: zlib's CRC-32 under "crc32"
// for each file and its blocks.
void as_version_1(const fs::path& folder) {
  json m = json::parse(read_file(folder / "manifest.json"));
  m["format_version"] = 1;
  for (auto& f : m["files"]) {
    const std::string bytes = read_file(folder / f.at("path").get<std::string>());
    f.erase("crc32c");
    f["crc32"] = detail::crc_text(crc32(bytes.data(), bytes.size()));
    std::string blocks;
    for (size_t at = 0; at < bytes.size(); at += detail::kBlockBytes) {
      const size_t n = std::min(bytes.size() - at, static_cast<size_t>(detail::kBlockBytes));
      blocks += detail::crc_text(crc32(bytes.data() + at, n));
    }
    f["blocks"].erase("crc32c");
    f["blocks"]["crc32"] = blocks;
  }
  write_manifest(folder, m);
}

// Flips one byte of the shard file in `folder`, at `at` bytes into its "param" section.
void corrupt(const fs::path& folder, int64_t at) {
  const json m = json::parse(read_file(folder / "manifest.json"));
  const auto& f = m.at("files")[0];
  int64_t offset = 0;
  for (const auto& s : f.at("sections")) {
    if (s.at("name") == "param") offset = s.at("offset").get<int64_t>();
  }
  const fs::path path = folder / f.at("path").get<std::string>();
  std::string bytes = read_file(path);
  bytes[static_cast<size_t>(offset + at)] ^= 0x10;
  write_file(path, bytes);
}

// Without the element sums the ranged reads verify each block they read (Note [Block
// checksums]): a manifest as written before sums were recorded.
void drop_element_sums(const fs::path& folder) {
  json m = json::parse(read_file(folder / "manifest.json"));
  for (auto& p : m["parameters"]) p.erase("sums");
  m.erase("manifest_crc32");
  write_file(folder / "manifest.json", detail::dump(m, 1));
}

// Versions 1 (zlib's CRC-32) and 2 (block checksums in the manifest) still load, whole
// (load_checkpoint) and by ranges (the grid load), and a flipped byte is caught by the checksum
// of its version: the file's, or the block's.
TEST(CheckpointFormat, VersionOneLoadsAndEitherChecksumCatchesAFlippedByte) {
  auto comm = make_single_communicator();
  const ParallelGroups g = make_parallel_groups(comm, ParallelLayout{1, 1, 1});
  for (const int version : {3, 2, 1}) {
    const bool v1 = version == 1;
    TempDir dir;
    BigNet net;
    auto opt = big_optimizer(net, g, 2, AdamW(0.01));
    const std::string ckpt = dir / "ckpt";
    opt->save_checkpoint(ckpt);
    if (version <= 2) as_version_2(ckpt);
    if (v1) as_version_1(ckpt);
    EXPECT_EQ(read_checkpoint_info(ckpt).format_version, version);
    {
      BigNet fresh;
      auto other = big_optimizer(fresh, g, 1, AdamW(0.01));
      load_checkpoint(*other, ckpt);
      BigNet fresh2;
      auto ranged = big_optimizer(fresh2, g, 3, AdamW(0.01));
      load_grid_checkpoint(*ranged, g, ckpt);
      const FullState full = read_full_state(ckpt);
      ASSERT_EQ(full.params.size(), 4u);
      EXPECT_TRUE(full.params["p2"].equal(net.params[2].detach()));
      auto& x = detail::shard_access(*opt);
      for (DistributedOptimizer* o : {other.get(), ranged.get()}) {
        auto& y = detail::shard_access(*o);
        for (size_t bk = 0; bk < x.layout().buckets.size(); ++bk) {
          const int b = static_cast<int>(bk);
          EXPECT_TRUE(x.owned_state_slice(1, b).equal(y.owned_state_slice(1, b))) << v1;
        }
      }
    }
    const std::string name = v1 ? "CRC-32 is" : "CRC-32C is";
    // The whole file's checksum (load_checkpoint reads it whole).
    const std::string bad = dir / "bad";
    fs::copy(ckpt, bad);
    corrupt(bad, 4 * 5000 + 1);
    {
      BigNet fresh;
      auto other = big_optimizer(fresh, g, 2, AdamW(0.01));
      expect_error([&] { load_checkpoint(*other, bad); }, ErrorKind::Checkpoint,
                   {"checksum mismatch in shard file", name, "corrupt"});
    }
    // A block's, read by range.
    const std::string ranged = dir / "ranged";
    fs::copy(ckpt, ranged);
    drop_element_sums(ranged);
    corrupt(ranged, 4 * 5000 + 1);
    {
      BigNet fresh;
      auto other = big_optimizer(fresh, g, 3, AdamW(0.01));
      expect_error([&] { load_grid_checkpoint(*other, g, ranged); }, ErrorKind::Checkpoint,
                   {"checksum mismatch in shard file", "bytes [", name,
                    version == 3 ? "the block table says" : "the manifest says"});
    }
  }
}

// Note [Block tables]: a ranged read checks the file's block table against the manifest before it
// trusts a block to it, and the manifest's record of the table must fit the file.
TEST(CheckpointFormat, VersionThreeChecksItsBlockTable) {
  auto comm = make_single_communicator();
  const ParallelGroups g = make_parallel_groups(comm, ParallelLayout{1, 1, 1});
  TempDir dir;
  BigNet net;
  auto opt = big_optimizer(net, g, 2, AdamW(0.01));
  const fs::path ckpt = dir / "ckpt";
  opt->save_checkpoint(ckpt.string());
  drop_element_sums(ckpt);  // so that the grid load verifies the blocks it reads
  const json m = json::parse(read_file(ckpt / "manifest.json"));
  const json& f = m.at("files")[0];
  const int64_t table = f.at("blocks").at("table_offset").get<int64_t>();
  EXPECT_EQ(table % detail::kBlockBytes, 0);
  EXPECT_EQ(table + 4 * f.at("blocks").at("count").get<int64_t>(), f.at("bytes").get<int64_t>());
  const fs::path bad = dir / "bad";
  fs::copy(ckpt, bad);
  {
    const fs::path path = bad / f.at("path").get<std::string>();
    std::string bytes = read_file(path);
    bytes[static_cast<size_t>(table + 5)] ^= 0x01;
    write_file(path, bytes);
    BigNet fresh;
    auto other = big_optimizer(fresh, g, 3, AdamW(0.01));
    expect_error([&] { load_grid_checkpoint(*other, g, bad.string()); }, ErrorKind::Checkpoint,
                 {"checksum mismatch in the block table of shard file", "corrupt"});
  }
  const fs::path moved = dir / "moved";
  fs::copy(ckpt, moved);
  {
    json edited = m;
    edited["files"][0]["blocks"]["table_offset"] = table - detail::kBlockBytes;
    write_manifest(moved, edited);
    expect_error([&] { read_checkpoint_info(moved.string()); }, ErrorKind::Checkpoint,
                 {"the block table of", "is malformed"});
  }
}

}  // namespace
}  // namespace shardopt
