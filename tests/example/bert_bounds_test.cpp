// Resource bounds of the example's readers of outside files: a safetensors header, the pretraining
// data file and a BERT config that claim absurd sizes, negative or wrapping counts, or sections
// past the end of the file are refused with an error naming the file and the field, before any
// allocation larger than the file (issue 42).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bert_config.hpp"
#include "data.hpp"
#include "shardopt/safetensors.hpp"
#include "tokenizer.hpp"

namespace bert {
namespace {

namespace safetensors = shardopt::safetensors;  // the library's reader and writer

namespace fs = std::filesystem;

std::string scratch(const std::string& name) {
  const auto dir = fs::temp_directory_path() / ("bert_bounds_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return (dir / name).string();
}

// The message of the std::exception `fn` throws ("" when it throws none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

void write_safetensors_raw(const std::string& path, const std::string& header, size_t data_bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const uint64_t n = header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << std::string(data_bytes, '\0');
}

TEST(SafetensorsBounds, AbsurdShapesAndOffsetsAreNamed) {
  const std::string path = scratch("bounds.safetensors");
  auto read = [&] { return error_of([&] { safetensors::read(path); }); };
  // 10^15 elements that the offsets claim too: past the 8 bytes the file has.
  write_safetensors_raw(
      path, R"({"a":{"dtype":"F32","shape":[1000000000000000],"data_offsets":[0,4000000000000000]}})",
      8);
  EXPECT_NE(read().find(path), std::string::npos) << read();
  EXPECT_NE(read().find("'a': field data_offsets [0,4000000000000000] outside the 8 data bytes"),
            std::string::npos)
      << read();
  // 2^62 * 4 elements of 4 bytes wrap around to 0 bytes, which the offsets [0, 0] agree with: a
  // tensor of 2^64 elements over no data unless the product is checked.
  write_safetensors_raw(
      path, R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})", 0);
  EXPECT_NE(read().find("'a': field shape [4611686018427387904, 4] of F32 needs more than 2^64 "
                        "bytes"),
            std::string::npos)
      << read();
  write_safetensors_raw(path, R"({"a":{"dtype":"F32","shape":[-2,-2],"data_offsets":[0,16]}})",
                        16);
  EXPECT_NE(read().find("'a': field shape [-2, -2] has a negative dimension"), std::string::npos)
      << read();
  write_safetensors_raw(path, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", 8);
  EXPECT_NE(read().find("field data_offsets [-8,0] outside"), std::string::npos) << read();
  // An empty tensor stays fine whatever its other dimensions.
  write_safetensors_raw(path, R"({"a":{"dtype":"F32","shape":[1000000000000000,0],"data_offsets":[0,0]}})", 0);
  EXPECT_EQ(read(), "");
  // A directory is no file of unknown size.
  const std::string dir = scratch("a-directory.safetensors");
  fs::create_directories(dir);
  EXPECT_NE(error_of([&] { safetensors::read(dir); }).find("not a regular file"), std::string::npos);
}

// A valid file of a few instances, then its header edited in place.
class DataBounds : public ::testing::Test {
 protected:
  DataBounds() {
    std::vector<std::string> t = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"};
    for (int i = 0; i < 20; ++i) t.push_back("w" + std::to_string(i));
    std::vector<Instance> instances(3);
    for (auto& inst : instances) {
      inst.input_ids = {2, 5, 6, 3, 7, 3};
      inst.segment_a_length = 4;
      inst.masked_positions = {1};
      inst.masked_labels = {5};
    }
    PretrainOptions opt;
    opt.max_seq_length = 16;
    opt.max_predictions_per_seq = 4;
    write_pretraining_file(path, instances, opt, Vocab(t), /*lower_case=*/true, 1);
    std::ifstream in(path, std::ios::binary);
    in.read(reinterpret_cast<char*>(&header), sizeof(header));
  }
  ~DataBounds() override { std::remove(path.c_str()); }
  void patch(const DataHeader& h) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.write(reinterpret_cast<const char*>(&h), sizeof(h));
  }
  std::string open() {
    return error_of([&] { PretrainingData data(path); });
  }
  std::string path = scratch("bounds-data.bin");
  DataHeader header{};
};

TEST_F(DataBounds, AValidFileOpens) { EXPECT_EQ(open(), ""); }

// 2^61 instances: every section's size wraps around to 0 bytes in 64 bits, so unchecked sums
// accepted it, and the loader's permutation then asked for 16 EiB.
TEST_F(DataBounds, AnInstanceCountThatWrapsIsNamed) {
  DataHeader h = header;
  h.num_instances = uint64_t{1} << 61;
  patch(h);
  const std::string e = open();
  EXPECT_NE(e.find(path), std::string::npos) << e;
  EXPECT_NE(e.find("header field input_ids_offset"), std::string::npos) << e;
  EXPECT_NE(e.find("num_instances 2305843009213693952"), std::string::npos) << e;
  h = header;
  h.meta_offset = h.file_bytes - 8;  // the last section past the end of the file
  patch(h);
  EXPECT_NE(open().find("header field meta_offset"), std::string::npos) << open();
  h = header;
  h.masked_labels_offset += 2;  // misaligned int32
  patch(h);
  EXPECT_NE(open().find("header field masked_labels_offset"), std::string::npos) << open();
}

// An instance whose lengths exceed its row: batch() wrote past its arrays.
TEST_F(DataBounds, InstanceLengthsOutsideTheRowAreNamed) {
  for (const int16_t bad : {int16_t{5}, int16_t{-1}}) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(header.meta_offset + 2 * 2));  // instance 0's masked count
    f.write(reinterpret_cast<const char*>(&bad), 2);
    f.close();
    const std::string e = open();
    EXPECT_NE(e.find("instance 0 has lengths (6, 4, " + std::to_string(bad) + ", 0)"),
              std::string::npos)
        << e;
  }
}

TEST(BertConfigBounds, AbsurdSizesAreNamed) {
  nlohmann::json j = BertConfig::preset("tiny").to_hf_json();
  auto error = [&](const char* key, const nlohmann::json& value) {
    nlohmann::json k = j;
    k[key] = value;
    return error_of([&] { BertConfig::from_json(k, "cfg.json"); });
  };
  // A double past int64 was cast (undefined behaviour); 10^15 made the embedding's allocation.
  EXPECT_EQ(error("vocab_size", 1e300),
            "cfg.json: 'vocab_size' expected an integer in [1, 2147483647], got 1e+300");
  EXPECT_EQ(error("vocab_size", 1000000000000000),
            "cfg.json: 'vocab_size' expected an integer in [1, 2147483647], got 1000000000000000");
  const std::string big = error("num_hidden_layers", 2000000000);
  EXPECT_NE(big.find("cfg.json: the sizes describe"), std::string::npos) << big;
  EXPECT_NE(big.find("more than the limit of 1.1e+12"), std::string::npos) << big;
}

}  // namespace
}  // namespace bert
